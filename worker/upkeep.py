"""Keeping the worker's standing: the heartbeat (hash, lease, model card, and a touch of every
held entry so its idle time stays low), deadlines (queued and running jobs past theirs), and
the reclaim of entries idle past the lease whose worker's heartbeat is gone."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket
import time
from typing import Any, cast

from redis.exceptions import ResponseError

from shared import __version__
from shared.deadlines import expire_due
from shared.keys import CONSUMER_GROUP
from shared.loops import REDIS_FAILURES, keep_running, log_failure
from shared.records import Heartbeat, QueueEntry, RecordError
from worker.admission import Admission
from worker.engine import Stop
from worker.entries import drop_malformed
from worker.jobstate import Claim
from worker.lease import reclaimable
from worker.link import StepTimes
from worker.news import NewsDesk
from worker.repair import repair_finished
from worker.state import WorkerState

log = logging.getLogger(__name__)
_RECLAIM_SCAN = 1000
"""Idle pending entries looked at per queue and reclaim round."""
_EXPIRE_SWEEP = 1000
"""Overdue jobs looked at per heartbeat."""


class Upkeep:
    def __init__(self, st: WorkerState, news: NewsDesk) -> None:
        self.st = st
        self.news = news
        self.started_at = time.time()
        self._tokens_at_beat = (time.monotonic(), 0)
        self._times_at_beat = StepTimes()
        self.tokens_per_s = 0.0
        self._redis_run_id: str | None = None
        self._trimmed = True
        """Freed memory was handed back since the worker last held a job."""
        self._published_cache = -1
        """The cache model's version the last beat wrote (-1: none yet)."""

    async def heartbeat_loop(self) -> None:
        st = self.st

        async def step() -> None:
            self._expire_overdue()
            await self.beat()
            try:
                await self._expire_queued()
            except REDIS_FAILURES as exc:
                log_failure(log, st.redis, "deadline sweep failed", exc)

        await keep_running(
            step,
            failed="heartbeat failed",
            log=log,
            every_s=st.settings.heartbeat_s,
            redis=st.redis,
            running=lambda: not st.closing,
            on_failure=lambda exc: st.lease.beat_failed(),
        )

    async def publish_card(self) -> None:
        st = self.st
        card = st.engine.card
        await st.redis.hset(
            st.keys.model_card(st.model),
            mapping={"card": card.model_dump_json(), "tokenizer": st.engine.tokenizer_json},
        )
        await st.redis.sadd(st.keys.models(), st.model)

    async def beat(self) -> None:
        st = self.st
        st.forget_finished()
        self._trim_when_idle()
        news = self.news.call()
        if news is not None:  # first: a gateway reading this beat has heard what it says
            await st.scripts.run(news)
        hb = self._heartbeat()
        lease_ms = int(st.settings.lease_s * 1000)
        pipe = st.redis.pipeline(transaction=False)
        pipe.exists(st.keys.model_card(st.model))  # first: its reply is read below
        key = st.keys.worker(st.id)
        fields = hb.to_hash()
        pipe.hset(key, mapping=fields)
        unset = [f for f in Heartbeat.model_fields if f not in fields]  # e.g. engine_down, now
        if unset:
            pipe.hdel(key, *unset)
        pipe.pexpire(key, lease_ms)
        summary = st.keys.cache_summary(st.id)
        if hb.cache_version != self._published_cache:  # what placement reads of this cache
            pipe.set(summary, st.cache.summary(), px=lease_ms)
        else:
            pipe.pexpire(summary, lease_ms)
        pipe.zadd(st.keys.workers(), {st.id: time.time() + st.settings.lease_s})
        pipe.sadd(st.keys.models(), st.model)
        card_exists, *_ = await pipe.execute()
        self._published_cache = hb.cache_version
        # Not after a lapsed lease: the entries may have moved to another worker meanwhile.
        if st.lease.held():
            await self._touch_held()
        st.lease.beat_ok()
        if not card_exists:  # Redis lost it (restarted without its data): gateways need it
            await self.publish_card()
        await self._after_restart()

    def _trim_when_idle(self) -> None:
        """Once a worker has nothing left of its jobs, hand the heap's freed pages back to
        the system: the allocator keeps them after a burst of long jobs otherwise, and the
        worker's RSS would stay at the burst's peak."""
        st = self.st
        idle = not (st.running or st.waiting or st.finished)
        if idle and not self._trimmed:
            release_freed_memory()
        self._trimmed = idle

    async def _after_restart(self) -> None:
        """A Redis that restarted (a new run id) may have lost its last writes: the ends of
        the jobs this worker finished just before are written again from memory."""
        try:
            run_id = str((await self.st.redis.info("server")).get("run_id", ""))
        except ResponseError:  # a Redis without INFO (fakeredis): never restarts under us
            return
        known, self._redis_run_id = self._redis_run_id, run_id
        if known is None or known == run_id:
            return
        log.warning("Redis restarted; checking the jobs this worker just finished")
        repaired = await repair_finished(self.st)
        if repaired:
            log.warning("rewrote lost job ends", extra={"jobs": len(repaired)})

    async def _touch_held(self) -> None:
        """Reset the idle time of the entries this worker holds (a dead worker's go idle and
        are reclaimed); let go of those it no longer owns: they moved while it was away."""
        st = self.st
        started = [(r.claim, r.attempt) for r in st.running.values() if r.end is None]
        held = started + [(c, None) for c in st.waiting]
        calls = [
            st.transitions.touch(
                c.queue, c.entry_id, c.job_id, group=CONSUMER_GROUP, worker=st.id, attempt=a
            )
            for c, a in held
        ]
        for (claim, attempt), still in zip(held, await st.scripts.run_all(calls), strict=True):
            if still is not False:
                continue  # touched, or an error this once: next beat
            if attempt is None:
                st.waiting = [c for c in st.waiting if c.entry_id != claim.entry_id]
            else:
                run = st.running.get(claim.job_id)
                if run is None or run.attempt != attempt or run.end is not None:
                    continue  # it ended here meanwhile (its end let go of the entry)
                st.drop(claim.job_id)
            log.warning("entry moved to another worker; letting go", extra={"job_id": claim.job_id})

    def _heartbeat(self) -> Heartbeat:
        st = self.st
        engine = st.engine
        now_m = time.monotonic()
        tokens = engine.tokens
        t0, n0 = self._tokens_at_beat
        if now_m > t0:
            self.tokens_per_s = (tokens - n0) / (now_m - t0)
        self._tokens_at_beat = (now_m, tokens)
        times, before = engine.times.snapshot(), self._times_at_beat
        kv_used, kv_total = _kv_pages(engine.admission)
        self._times_at_beat = times
        return Heartbeat(
            worker_id=st.id,
            model=st.model,
            engine=engine.card.engine,
            gpu=os.environ.get("CUDA_VISIBLE_DEVICES"),
            host=socket.gethostname(),
            pid=os.getpid(),
            version=__version__,
            capacity=engine.max_batch,
            tokens_per_s=round(self.tokens_per_s, 1),
            started_at=self.started_at,
            draining=st.stopping.is_set(),
            engine_pid=engine.pid,
            engine_down=engine.down,
            engine_restarts=engine.restarts,
            engine_step_ms=_mean_ms(times.engine_s - before.engine_s, times.steps - before.steps),
            worker_step_ms=_mean_ms(
                times.interval_s - before.interval_s, times.intervals - before.intervals
            ),
            steps=times.steps,
            engine_step_s=round(times.engine_s, 3),
            worker_steps=times.intervals,
            worker_step_s=round(times.interval_s, 3),
            beat_at=time.time(),
            kv_pages_used=kv_used,
            kv_pages_total=kv_total,
            cache_version=st.cache.version,
            cache_pages=len(st.cache),
            **self.news.load(),
        )

    async def _expire_queued(self) -> None:
        """End jobs past their deadline that nobody else will end (queued ones, whoever's
        backlog they wait in, and those of dead workers); any process may sweep."""
        st = self.st
        for job_id in await expire_due(st.redis, st.scripts, st.keys, st.settings, _EXPIRE_SWEEP):
            log.info("queued job expired", extra={"job_id": job_id})

    def _expire_overdue(self) -> None:
        """Stop running jobs past their deadline; they end `expired` (see `Flusher._collect`)."""
        st = self.st
        now = time.time()
        for run in list(st.running.values()):
            deadline = run.spec.deadline
            if deadline is not None and now > deadline:
                st.stop(run, Stop("expired"))

    async def reclaim_loop(self) -> None:
        """Take over entries idle for a whole lease whose owner's heartbeat is gone."""
        st = self.st

        async def step() -> None:
            if st.stopping.is_set() or not st.lease.reclaim_allowed():
                return
            for queue in st.all_streams():
                await self._reclaim(queue)
                await self._forget_dead(queue)
            for lane in await self._other_lanes():
                try:
                    await self._reclaim(lane)
                    await self._forget_dead(lane)
                except ResponseError as exc:  # a lane its worker never read: no group
                    if "NOGROUP" not in str(exc):
                        raise

        await keep_running(
            step,
            failed="reclaim failed",
            log=log,
            every_s=st.settings.heartbeat_s,
            redis=st.redis,
            running=lambda: not st.closing,
        )

    async def _other_lanes(self) -> list[str]:
        """Other workers' lanes of this worker's model: what a dead one had started is
        pending there and is reclaimed like any entry (what it had not, the steal sweep
        moves to the shared queue)."""
        st, k = self.st, self.st.keys
        lanes: set[str] = set()
        for shard in range(k.shards):  # each queue shard's set (one on one Redis)
            lanes |= await st.redis.smembers(k.placed_lanes(shard))
        mine = {k.placed(st.model, p, st.id, i) for p in st.queues for i in range(k.shards)}
        prefixes = tuple(
            k.placed_prefix(st.model, p, i) for p in st.queues for i in range(k.shards)
        )
        return sorted(lane for lane in lanes if lane.startswith(prefixes) and lane not in mine)

    async def _forget_dead(self, queue: str) -> None:
        """A crashed worker's consumer, once it holds no entry (all reclaimed) and its lease
        is over, leaves the group, and its member the workers set: else one of each stays
        per crash, forever."""
        st = self.st
        lease_ms = int(st.settings.lease_s * 1000)
        consumers: list[dict[str, Any]] = await st.redis.xinfo_consumers(queue, CONSUMER_GROUP)
        idle = [
            str(c["name"])
            for c in consumers
            if c["name"] != st.id and int(c["pending"]) == 0 and int(c["idle"]) > lease_ms
        ]
        if not idle:
            return
        pipe = st.redis.pipeline(transaction=False)
        for name in idle:
            pipe.exists(st.keys.worker(name))
        dead = [n for n, alive in zip(idle, await pipe.execute(), strict=True) if not alive]
        calls = [
            st.transitions.delete_idle_consumer(queue, group=CONSUMER_GROUP, consumer=n)
            for n in dead
        ]
        gone = [
            n for n, ok in zip(dead, await st.scripts.run_all(calls), strict=True) if ok is True
        ]
        if gone:
            # Only members whose lease has passed: a worker that just restarted under the
            # same id (and beats again) keeps its place.
            expired = time.time()
            scores = await st.redis.zmscore(st.keys.workers(), gone)
            stale = [n for n, s in zip(gone, scores, strict=True) if s is None or s < expired]
            if stale:
                await st.redis.zrem(st.keys.workers(), *stale)
            log.info("forgot dead workers", extra={"workers": gone, "queue": queue})

    async def _reclaim(self, queue: str) -> None:
        st = self.st
        free = st.free_slots()
        if free <= 0:
            return
        idle_ms = int(st.settings.lease_s * 1000)
        pending: list[dict[str, Any]] = await st.redis.xpending_range(
            queue, CONSUMER_GROUP, "-", "+", _RECLAIM_SCAN, idle=idle_ms
        )
        if not pending:
            return
        owners = sorted({str(p["consumer"]) for p in pending} - {st.id})
        pipe = st.redis.pipeline(transaction=False)
        for owner in owners:
            pipe.exists(st.keys.worker(owner))
        alive = {o for o, n in zip(owners, await pipe.execute(), strict=True) if n}
        held = {r.claim.entry_id for r in st.running.values()}
        held |= {c.entry_id for c in st.waiting}
        pairs = [(str(p["message_id"]), str(p["consumer"])) for p in pending]
        ids = reclaimable(pairs, st.id, held, alive)[:free]
        if not ids:
            return
        # XCLAIM re-checks the idle time: an owner that touched an entry meanwhile keeps it.
        reply = await st.redis.xclaim(queue, CONSUMER_GROUP, st.id, idle_ms, cast(Any, ids))
        for entry_id, fields in cast("list[tuple[str, dict[str, str] | None]]", reply):
            if not fields:
                continue
            try:
                entry = QueueEntry.from_hash(fields)
            except RecordError as exc:
                await drop_malformed(st, queue, entry_id, str(exc))
                continue
            claim = Claim(entry_id, queue, entry.job, entry.tokens, entry.owner)
            if claim.job_id in st.finished and await repair_finished(st, [claim.job_id]):
                continue  # it had ended here: its lost end is written again, not re-run
            log.info("reclaimed job", extra={"job_id": claim.job_id, "worker_id": st.id})
            st.metrics.reclaims.inc()
            st.waiting.append(claim)
        st.room.set()


def release_freed_memory() -> None:
    """glibc's `malloc_trim(0)`: return the free pages of every heap arena to the system
    (a few milliseconds; nothing where the C library is not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _kv_pages(admission: Admission) -> tuple[int, int]:
    """(used, total) cache pages as the engine last reported them; (0, 0) for an engine
    that counts no pages."""
    if not admission.page_size:
        return 0, 0
    return max(0, admission.total_pages - admission.free_pages), admission.total_pages


def _mean_ms(seconds: float, count: int) -> float:
    return round(seconds / count * 1000, 3) if count > 0 else 0.0
