"""The worker: claim → start → (engine thread steps) → flush events → finish, as asyncio tasks.

Phases, each a task:
  claim      XREADGROUP from the model's queues (interactive first, every `batch_share`-th
             claim a batch job) only while the engine has room; START each claim atomically.
  flush      drain the engine's outputs; one pipeline per drain carries every job's events
             (EMIT/FINISH scripts, fenced on worker + attempt); ack what ended.
  heartbeat  refresh the heartbeat hash, the lease and the model card; touch held entries so
             their idle time stays low (a dead worker's entries go idle and are reclaimed);
             end running jobs past their deadline.
  reclaim    XCLAIM entries idle past the lease whose worker's heartbeat is gone.
  control    the worker's control channel: cancels.

Every loop runs under a supervisor: an unexpected exception is logged and the loop restarts,
so no phase can die silently while the heartbeat keeps the worker looking alive.

An engine error on one job is not the job's end: the job is handed back to the queue for
another attempt (counted), and dead-lettered once its attempts are spent; the rest of the
batch goes on. A drain's hand-back is not counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from shared import __version__
from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys, Priority
from shared.redisconn import connect
from shared.schemas import ControlMessage, Heartbeat, JobSpec
from shared.scripts import Scripts
from shared.settings import Settings
from worker.engine import Engine, EngineJob, StepOutput
from worker.jobstate import Claim, RunningJob
from worker.lease import LeaseClock, reclaimable
from worker.runner import EngineRunner

log = logging.getLogger("genq.worker")
_MAX_ENGINE_FAILURES = 5
_EARLY_CANCELS_KEPT = 1000
_FLUSH_RETRY_S = 0.2
_TASK_STOP_TIMEOUT_S = 2.0
_CONTROL_POLL_S = 1.0
_EARLY_CANCEL_TTL_S = 60.0
_LOOP_RESTART_S = 0.5
_RECLAIM_SCAN = 1000
"""Idle pending entries looked at per queue and reclaim round."""
_DEAD_LETTERS_KEPT = 100_000
_EXPIRE_SWEEP = 1000
"""Overdue jobs looked at per heartbeat."""


class Worker:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        redis: aioredis.Redis | None = None,
        model_name: str | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.model = model_name or settings.model_name or engine.card.name
        self.engine.card.name = self.model
        if settings.chat_template is not None:  # e.g. a model whose tokenizer_config lacks one
            self.engine.card.chat_template = settings.chat_template
        self.id = (
            settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.keys = Keys(settings.key_prefix)
        self.redis = redis or connect(settings)
        self.scripts = Scripts.register(self.redis)
        self.queues = {p: self.keys.queue(self.model, p) for p in PRIORITIES}
        self.running: dict[str, RunningJob] = {}
        self.waiting: list[Claim] = []
        self._dirty: set[str] = set()
        self._early_cancels: dict[str, float] = {}
        self._cancel_reason: dict[str, str] = {}
        self._expiring: set[str] = set()
        self.lease = LeaseClock(settings.lease_s)
        self._flush_wanted = asyncio.Event()
        self._urgent: set[str] = set()
        """Dirty jobs whose events should not wait for the flush interval."""
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._closing = False
        self._claims_since_batch = 0
        self._started_at = time.time()
        self._tokens_at_beat = (time.monotonic(), 0)
        self.tokens_per_s = 0.0
        self.runner: EngineRunner | None = None
        self.healthy = True

    # ---- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until `stop()`; then stop claiming, let running jobs finish, and leave."""
        loop = asyncio.get_running_loop()
        self.runner = EngineRunner(self.engine, loop, self._flush_wanted.set)
        await self._prepare_when_redis_answers()
        if self._stopping.is_set():
            return
        self.runner.start()
        log.info("worker started", extra={"worker_id": self.id, "model": self.model})
        loops = {
            "claim": self._claim_loop,
            "flush": self._flush_loop,
            "heartbeat": self._heartbeat_loop,
            "reclaim": self._reclaim_loop,
            "control": self._control_loop,
        }
        tasks = [asyncio.create_task(self._supervise(n, f), name=n) for n, f in loops.items()]
        try:
            await self._stopping.wait()  # the claim loop sees it too and claims no more
            await self._drain(self.settings.shutdown_grace_s)
        finally:
            self._closing = True  # loops check it too: a swallowed cancel must not hang us
            self._flush_wanted.set()
            for t in tasks:
                t.cancel()
            # Bounded: a Redis client can swallow a cancel that races a read timeout.
            _, stuck = await asyncio.wait(tasks, timeout=_TASK_STOP_TIMEOUT_S)
            if stuck:
                log.warning("tasks did not stop", extra={"tasks": [t.get_name() for t in stuck]})
            self.runner.stop()
            with contextlib.suppress(RedisError, OSError):
                await self._leave()

    def stop(self) -> None:
        self._stopping.set()

    async def _supervise(self, name: str, loop: Any) -> None:
        """Run one phase until closing: a crash is logged and the phase restarts."""
        while not self._closing:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker loop crashed; restarting it", extra={"loop": name})
                await asyncio.sleep(_LOOP_RESTART_S)
                self._flush_wanted.set()  # whatever it was doing, the next flush picks up
                self._room.set()

    async def _prepare_when_redis_answers(self) -> None:
        """A worker started while Redis is away waits for it (until stopped) instead of dying."""
        while not self._stopping.is_set():
            try:
                await self._prepare()
                return
            except (RedisError, OSError) as exc:
                log.warning("Redis unreachable at start; retrying", extra={"error": str(exc)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.settings.heartbeat_s)

    async def _prepare(self) -> None:
        await self._ensure_groups()
        await self._publish_card()
        await self._beat()

    async def _publish_card(self) -> None:
        card = self.engine.card
        await self.redis.hset(
            self.keys.model_card(self.model),
            mapping={"card": card.model_dump_json(), "tokenizer": self.engine.tokenizer_json},
        )
        await self.redis.sadd(self.keys.models(), self.model)

    async def _ensure_groups(self) -> None:
        for key in self.queues.values():
            with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
                await self.redis.xgroup_create(key, CONSUMER_GROUP, id="0", mkstream=True)

    async def _drain(self, grace_s: float) -> None:
        """Hand back claims not started yet at once; let running jobs finish for up to
        `grace_s`; hand the rest back. A failed hand-back leaves the entry to be reclaimed."""
        deadline = time.monotonic() + grace_s
        await self._requeue_waiting()
        while self.running and time.monotonic() < deadline:
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), deadline - time.monotonic())
        await self._requeue_waiting()  # what a reclaim in flight at SIGTERM brought in
        for job_id in list(self.running):
            assert self.runner is not None
            self.runner.cancel(job_id)
            run = self.running.pop(job_id)
            with contextlib.suppress(RedisError, OSError):
                await self._hand_back(run, counted=False)

    async def _requeue_waiting(self) -> None:
        waiting, self.waiting = self.waiting, []
        for claim in waiting:
            with contextlib.suppress(RedisError, OSError):
                await self._requeue(claim)

    async def _hand_back(self, run: RunningJob, *, counted: bool, error: str = "") -> None:
        """Give a started job back to the queue for any worker, now (not after the lease).
        Fenced: a job that already moved to another worker is left alone."""
        reply = await self.scripts.hand_back(
            keys=[self.keys.job(run.id)],
            args=[self.id, str(run.attempt), "1" if counted else "0", error],
        )
        if reply:
            await self._requeue(run.claim)
        else:
            log.warning("hand-back fenced: the job moved on", extra={"job_id": run.id})

    async def _requeue(self, claim: Claim) -> None:
        """A fresh queue entry for the job, and ours acknowledged, in one transaction."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(claim.queue, {"job": claim.job_id, "tokens": claim.need_tokens})
        pipe.xack(claim.queue, CONSUMER_GROUP, claim.entry_id)
        pipe.xdel(claim.queue, claim.entry_id)
        await pipe.execute()

    async def _leave(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.id))
        pipe.zrem(self.keys.workers(), self.id)
        await pipe.execute()
        for key in self.queues.values():
            await self.scripts.delete_idle_consumer(keys=[key], args=[CONSUMER_GROUP, self.id])

    # ---- claim ------------------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.engine.max_batch - len(self.running) - len(self.waiting)

    async def _claim_loop(self) -> None:
        # The flag, not only cancellation: a client may swallow a cancel during a blocking read.
        while not self._stopping.is_set():
            try:
                if not self.lease.held():  # claims now could not be started: wait for a beat
                    await asyncio.sleep(self.settings.heartbeat_s)
                    continue
                await self._start_waiting()
                free = self._free_slots()
                if free <= 0 or self.waiting:
                    self._room.clear()
                    await self._room.wait()
                    continue
                claims = await self._claim(free)
                if claims:
                    self.waiting.extend(claims)
                if self._stopping.is_set():  # a read that SIGTERM overtook: give them back now
                    await self._requeue_waiting()
            except asyncio.CancelledError:
                raise
            except ResponseError as exc:
                log.warning("claim failed; retrying", extra={"error": str(exc)})
                if "NOGROUP" in str(exc):  # Redis lost the group (restarted without AOF)
                    with contextlib.suppress(RedisError, OSError):
                        await self._ensure_groups()
                await asyncio.sleep(_LOOP_RESTART_S)
            except (RedisError, OSError) as exc:
                log.warning("claim failed; retrying", extra={"error": str(exc)})
                await asyncio.sleep(_LOOP_RESTART_S)

    async def _claim(self, free: int) -> list[Claim]:
        """Take up to `free` entries, interactive first; block briefly when both are empty."""
        batch_turn = self._claims_since_batch >= self.settings.batch_share
        order: tuple[Priority, ...] = ("batch", "interactive") if batch_turn else PRIORITIES
        claims: list[Claim] = []
        for priority in order:
            want = 1 if priority == "batch" and batch_turn else free - len(claims)
            if want > 0:
                claims += await self._read({self.queues[priority]: ">"}, want, block=None)
        if not claims:
            streams = {k: ">" for k in self.queues.values()}
            claims = await self._read(streams, 1, block=self.settings.claim_block_ms)
        for c in claims:
            is_batch = c.queue == self.queues["batch"]
            self._claims_since_batch = 0 if is_batch else self._claims_since_batch + 1
        return claims

    async def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[Claim]:
        reply = await self.redis.xreadgroup(
            CONSUMER_GROUP,
            self.id,
            streams,
            count=count,
            block=block,  # type: ignore[arg-type]
        )
        return [
            Claim(entry_id, queue, fields["job"], int(fields.get("tokens", 0)))
            for queue, entries in _stream_items(reply)
            for entry_id, fields in entries
            if fields
        ]

    async def _start_waiting(self) -> None:
        """START every waiting claim the engine has room for, in one pipeline."""
        ready: list[Claim] = []
        active = len(self.running)
        while self.waiting and self.engine.fits(self.waiting[0].need_tokens, active + len(ready)):
            ready.append(self.waiting.pop(0))
        if not ready:
            return
        if not self.lease.held():
            # Paused or cut off for a whole lease: these entries may belong to another worker
            # now. Drop them; if they are still ours, the reclaim loop takes them back.
            log.warning("lease lapsed; dropping unstarted claims", extra={"claims": len(ready)})
            self._room.set()
            return
        try:
            replies, sent = await self._start(ready)
        except BaseException:
            self.waiting[:0] = ready  # START again later (a START that landed costs an attempt)
            raise
        await self._settle(ready, replies, sent)

    async def _start(
        self, ready: list[Claim]
    ) -> tuple[list[Any], dict[str, tuple[list[int], list[str]]]]:
        """START each claim (one pipeline) and read what retried ones already sent."""
        s = self.settings
        now = repr(time.time())
        pipe = self.redis.pipeline(transaction=False)
        for c in ready:
            await self.scripts.start(
                keys=self._job_keys(c.job_id),
                args=[self.id, now, s.max_attempts, s.retention_s, s.event_log_maxlen],
                client=pipe,
            )
        # A START that Redis rejects (a damaged record) comes back in place and sets aside
        # that claim alone; connection errors still raise and every claim is tried again.
        replies = await pipe.execute(raise_on_error=False)
        retried = [
            c.job_id
            for c, r in zip(ready, replies, strict=True)
            if not isinstance(r, Exception) and r[0] == "ok" and int(r[1]) > 1
        ]
        return replies, await self._sent_tokens(retried)

    async def _settle(
        self,
        ready: list[Claim],
        replies: list[Any],
        sent: dict[str, tuple[list[int], list[str]]],
    ) -> None:
        """Begin the STARTed jobs; ack the claims of jobs that had already ended. A failure
        here touches one claim only: an entry not acked stays pending and is reclaimed."""
        done_claims: list[Claim] = []
        for claim, reply in zip(ready, replies, strict=True):
            if isinstance(reply, Exception):
                # Left pending and not held: it is retried after a lease, costing only itself.
                log.error("START rejected", extra={"job_id": claim.job_id, "error": str(reply)})
                continue
            if reply[0] == "ok":
                resumed = sent.get(claim.job_id, ([], []))
                try:
                    self._begin(claim, int(reply[1]), int(reply[2]), reply[3], reply[4], resumed)
                except Exception as exc:  # e.g. a record that does not parse: fails alone
                    await self._give_up_start(claim, int(reply[1]), exc)
                continue
            if reply[0] == "exhausted":
                with contextlib.suppress(RedisError, OSError):
                    await self._dead_letter(claim, int(reply[1]))
            done_claims.append(claim)
        if done_claims:
            with contextlib.suppress(RedisError, OSError):
                await self._ack(done_claims)
        self._flush_wanted.set()

    async def _give_up_start(self, claim: Claim, attempt: int, exc: Exception) -> None:
        """A job that could not even begin: back to the queue as a failed attempt, so it is
        dead-lettered once they are spent instead of crashing the claim loop forever."""
        log.error("could not begin job", extra={"job_id": claim.job_id, "error": str(exc)})
        self.running.pop(claim.job_id, None)
        error = f"the worker could not begin the job: {exc}"
        with contextlib.suppress(RedisError, OSError):
            reply = await self.scripts.hand_back(
                keys=[self.keys.job(claim.job_id)], args=[self.id, str(attempt), "1", error]
            )
            if reply:
                await self._requeue(claim)

    async def _sent_tokens(self, job_ids: list[str]) -> dict[str, tuple[list[int], list[str]]]:
        """For retried jobs: the token ids and text an earlier attempt already published."""
        if not job_ids:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xrange(self.keys.events(job_id))
        sent: dict[str, tuple[list[int], list[str]]] = {}
        for job_id, entries in zip(job_ids, await pipe.execute(), strict=True):
            ids: list[int] = []
            texts: list[str] = []
            for _, fields in entries:
                ev = json.loads(fields["d"])
                if ev["type"] == "token":
                    ids += ev["token_ids"]
                    texts.append(ev["text"])
            sent[job_id] = (ids, texts)
        return sent

    def _begin(
        self,
        claim: Claim,
        attempt: int,
        seq: int,
        spec_json: str,
        cancel: str,
        resumed: tuple[list[int], list[str]],
    ) -> None:
        spec = JobSpec.model_validate_json(spec_json)
        run = RunningJob(
            spec=spec,
            claim=claim,
            attempt=attempt,
            seq=seq,
            started_wall=time.time(),
            resumed_ids=resumed[0],
            text_parts=list(resumed[1]),
        )
        self.running[spec.id] = run
        self._dirty.add(spec.id)
        run.started(self.id)
        self._urgent.add(spec.id)  # `started` (and an end at once, if any) need not wait
        if cancel or spec.id in self._early_cancels:
            self._early_cancels.pop(spec.id, None)
            run.cancelled(cancel or "cancelled")
            return
        if spec.deadline is not None and time.time() > spec.deadline:
            run.fail("expired", "deadline_exceeded", "the job's timeout passed before it started")
            return
        seed = spec.sampling.seed if spec.sampling.seed is not None else _seed_of(spec.id)
        assert self.runner is not None
        self.runner.add(
            EngineJob(
                id=spec.id,
                input_ids=spec.input_ids,
                max_tokens=spec.max_tokens,
                sampling=spec.sampling,
                seed=seed,
                resume_ids=resumed[0],
            )
        )

    async def _dead_letter(self, claim: Claim, attempts: int) -> None:
        entry = {"job": claim.job_id, "attempts": attempts, "at": repr(time.time())}
        await self.redis.xadd(
            self.keys.dead_letters(), entry, maxlen=_DEAD_LETTERS_KEPT, approximate=True
        )
        log.warning("job dead-lettered", extra={"job_id": claim.job_id, "attempts": attempts})

    async def _ack(self, claims: list[Claim]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for c in claims:
            pipe.xack(c.queue, CONSUMER_GROUP, c.entry_id)
            pipe.xdel(c.queue, c.entry_id)
        await pipe.execute()

    # ---- flush ------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        """Flush every `flush_interval_ms`; a job's first tokens and its end go out at once.

        Between flushes the engine keeps stepping and each job's tokens fold into one event,
        so the cost per token falls as load rises instead of swamping Redis and gateways.
        """
        assert self.runner is not None
        interval = self.settings.flush_interval_ms / 1000
        last_full = 0.0
        loop = asyncio.get_running_loop()
        armed = False

        def due_now() -> None:
            nonlocal armed
            armed = False
            self._flush_wanted.set()

        while not self._closing:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            self._collect(self.runner.drain())
            if not self._dirty:
                continue
            due = interval - (time.monotonic() - last_full)
            if due <= 0:
                last_full = time.monotonic()
                await self._flush(set(self._dirty))
            else:
                urgent = self._urgent & self._dirty
                if urgent:
                    await self._flush(urgent)
                if self._dirty and not armed:
                    armed = True
                    loop.call_later(due, due_now)

    def _collect(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            run = self.running.get(out.job_id)
            if run is None or run.end is not None or run.retry_error is not None:
                continue
            if out.token_ids or out.text:
                if run.first_token_wall is None:
                    self._urgent.add(run.id)
                run.add_tokens(out.text, out.token_ids, out.logprobs)
            if out.prompt_tokens:
                run.prompt_tokens = out.prompt_tokens
                run.cached_tokens = out.cached_tokens
            if out.error is not None:
                run.retry_error = out.error  # handed back after its tokens are flushed
            elif out.finish_reason == "cancelled" and run.id in self._expiring:
                self._expiring.discard(run.id)
                run.fail("expired", "deadline_exceeded", "the job's timeout passed while it ran")
            elif out.finish_reason == "cancelled":
                run.cancelled(self._cancel_reason.pop(run.id, "cancelled"))
            elif out.finish_reason is not None:
                run.finish(out.finish_reason)
            if run.end is not None or run.retry_error is not None:
                self._urgent.add(run.id)
            self._dirty.add(out.job_id)
        if self.runner is not None and self.runner.failures >= _MAX_ENGINE_FAILURES:
            log.error("engine keeps failing; stopping", extra={"worker_id": self.id})
            self.healthy = False
            self.stop()

    async def _flush(self, job_ids: set[str]) -> None:
        """One pipeline: these jobs' pending events (EMIT), or their ends (FINISH)."""
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        order: list[tuple[RunningJob, list[str]]] = []
        retries: list[RunningJob] = []
        self._dirty -= job_ids
        self._urgent -= job_ids
        for job_id in job_ids:
            run = self.running.get(job_id)
            if run is None:
                continue
            events = run.take_events()
            head = [self.id, str(run.attempt), str(s.event_log_maxlen)]
            if run.end is not None:
                status, fields = run.end
                record = [x for kv in fields.items() for x in kv]
                args = [*head, str(s.retention_s), str(len(events) // 2), *events]
                await self.scripts.finish(
                    keys=self._job_keys(job_id),
                    args=[*args, "status", status, *record],
                    client=pipe,
                )
            elif events:
                await self.scripts.emit(
                    keys=self._job_keys(job_id), args=head + events, client=pipe
                )
            elif run.retry_error is not None:
                retries.append(run)
                continue
            else:
                continue
            order.append((run, events))
        if retries:
            await self._retry(retries)
        if not order:
            return
        try:
            # Per-command errors come back in place: one job's rejected write must not fail
            # (and so retry forever) the flush of every other job in the pipeline.
            results = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            # Nothing is lost: the events go again (the scripts skip seqs already written).
            log.warning("flush failed; retrying", extra={"error": str(exc)})
            for run, events in order:
                run.pending[:0] = events
                self._dirty.add(run.id)
            await asyncio.sleep(_FLUSH_RETRY_S)
            self._flush_wanted.set()
            return
        ended: list[Claim] = []
        lost_tail: list[tuple[RunningJob, list[str], int]] = []
        for (run, events), ok in zip(order, results, strict=True):
            if isinstance(ok, Exception):
                log.error("Redis rejected events", extra={"job_id": run.id, "error": str(ok)})
                run.end, run.retry_error = None, f"Redis rejected the job's events: {ok}"
                self._flush_soon(run.id)  # handed back (counted) at the next flush
            elif ok < 0:  # Redis lost the end of the log: nothing was written
                lost_tail.append((run, events, -1 - ok))
            elif not ok:  # fenced: another worker owns this job now
                log.warning("lost ownership; dropping job", extra={"job_id": run.id})
                assert self.runner is not None
                self.runner.cancel(run.id)
                self.running.pop(run.id, None)
                self._room.set()
            elif run.end is not None:
                self.running.pop(run.id, None)
                ended.append(run.claim)
            else:
                run.remember(events, s.log_repair_window_s)
                if run.retry_error is not None:  # its tokens are out: hand it back next flush
                    self._flush_soon(run.id)
        for run, events, last in lost_tail:
            await self._repair(run, events, last)
        if ended:
            self._room.set()
            try:
                await self._ack(ended)
            except (RedisError, OSError) as exc:  # their entries go idle and are reclaimed
                log.warning("ack failed", extra={"error": str(exc)})

    async def _repair(self, run: RunningJob, events: list[str], last: int) -> None:
        """The job's log ends at `last`, short of what this worker wrote (Redis restarted
        without its last writes): write the lost events again, from memory, so readers see
        exactly what live subscribers saw. Past the repair window, hand the job back: the
        next attempt continues from what the log holds."""
        missing = run.written_after(last)
        if missing is None:
            log.warning("job log lost beyond repair; handing back", extra={"job_id": run.id})
            self.running.pop(run.id, None)
            assert self.runner is not None
            self.runner.cancel(run.id)
            self._room.set()
            with contextlib.suppress(RedisError, OSError):
                await self._hand_back(run, counted=False)
            return
        log.warning("job log lost its tail; re-sending", extra={"job_id": run.id, "from": last})
        run.pending[:0] = missing + events
        self._flush_soon(run.id)

    def _flush_soon(self, job_id: str) -> None:
        """Flush this job at once, not at the next flush interval."""
        self._dirty.add(job_id)
        self._urgent.add(job_id)
        self._flush_wanted.set()

    async def _retry(self, runs: list[RunningJob]) -> None:
        """Jobs that failed (in the engine, or Redis rejected their writes): back to the queue
        for another attempt (counted by START, which dead-letters them once spent)."""
        assert self.runner is not None
        for run in runs:
            self.running.pop(run.id, None)
            self.runner.cancel(run.id)  # the engine may still hold it (a write Redis rejected)
            log.warning(
                "job failed; handing it back",
                extra={"job_id": run.id, "attempt": run.attempt, "error": run.retry_error},
            )
            try:
                await self._hand_back(run, counted=True, error=run.retry_error or "")
            except (RedisError, OSError) as exc:  # still ours in the PEL: reclaimed later
                log.warning("hand-back failed", extra={"job_id": run.id, "error": str(exc)})
        self._room.set()

    def _job_keys(self, job_id: str) -> list[str]:
        k = self.keys
        return [k.job(job_id), k.events(job_id), k.channel(job_id)]

    # ---- cancel -----------------------------------------------------------------------

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        run = self.running.get(job_id)
        if run is None:  # a cancel can overtake the START reply that tells us of the job
            now = time.monotonic()
            if len(self._early_cancels) > _EARLY_CANCELS_KEPT:
                self._early_cancels = {
                    k: t for k, t in self._early_cancels.items() if now - t < _EARLY_CANCEL_TTL_S
                }
            self._early_cancels[job_id] = now
            return
        self._cancel_reason[job_id] = reason
        assert self.runner is not None
        self.runner.cancel(job_id)

    async def _control_loop(self) -> None:
        while not self._closing:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.control(self.id))
                await self._recheck_cancels()
                while not self._closing:
                    msg = await pubsub.get_message(timeout=_CONTROL_POLL_S)
                    if msg is not None:
                        self.cancel(ControlMessage.model_validate_json(msg["data"]).cancel)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, ValueError) as exc:
                log.warning("control channel failed; resubscribing", extra={"error": str(exc)})
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _recheck_cancels(self) -> None:
        """Cancels published while the control channel was down are lost; the job records
        still carry them (CANCEL sets `cancel`), so read those of every running job."""
        ids = list(self.running)
        if not ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(self.keys.job(job_id), "cancel")
        for job_id, reason in zip(ids, await pipe.execute(), strict=True):
            if reason:
                self.cancel(job_id, reason)

    # ---- heartbeat and reclaim -------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.settings.heartbeat_s)
            self._expire_overdue()
            try:
                await self._beat()
            except (RedisError, OSError) as exc:
                self.lease.beat_failed()
                log.warning("heartbeat failed", extra={"error": str(exc)})
                continue
            try:
                await self._expire_queued()
            except (RedisError, OSError) as exc:
                log.warning("deadline sweep failed", extra={"error": str(exc)})

    async def _expire_queued(self) -> None:
        """End queued jobs past their deadline, whoever's backlog they wait in (any worker may
        sweep: the script only touches jobs still `queued`)."""
        index = self.keys.deadlines()
        now = time.time()
        due: list[str] = await self.redis.zrangebyscore(  # type: ignore[assignment]
            index, "-inf", now, start=0, num=_EXPIRE_SWEEP
        )
        if not due:
            return
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        for job_id in due:
            await self.scripts.expire(
                keys=self._job_keys(job_id),
                args=[repr(now), s.retention_s, s.event_log_maxlen],
                client=pipe,
            )
        for job_id, reply in zip(due, await pipe.execute(), strict=True):
            if reply[0] == "expired":
                log.info("queued job expired", extra={"job_id": job_id})
        # Running jobs are their worker's to expire (`_expire_overdue`), or a reclaimer's.
        await self.redis.zrem(index, *due)

    def _expire_overdue(self) -> None:
        """Stop running jobs past their deadline; they end `expired` (see `_collect`)."""
        now = time.time()
        for run in self.running.values():
            deadline = run.spec.deadline
            if deadline is None or now <= deadline or run.end is not None or run.retry_error:
                continue
            if run.id not in self._expiring:
                self._expiring.add(run.id)
                assert self.runner is not None
                self.runner.cancel(run.id)

    async def _beat(self) -> None:
        now_m = time.monotonic()
        tokens = self.runner.tokens if self.runner else 0
        t0, n0 = self._tokens_at_beat
        if now_m > t0:
            self.tokens_per_s = (tokens - n0) / (now_m - t0)
        self._tokens_at_beat = (now_m, tokens)
        hb = Heartbeat(
            worker_id=self.id,
            model=self.model,
            engine=self.engine.card.engine,
            gpu=os.environ.get("CUDA_VISIBLE_DEVICES"),
            host=socket.gethostname(),
            pid=os.getpid(),
            version=__version__,
            capacity=self.engine.max_batch,
            active=len(self.running),
            tokens_per_s=round(self.tokens_per_s, 1),
            started_at=self._started_at,
            draining=self._stopping.is_set(),
        )
        lease_ms = int(self.settings.lease_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(self.keys.model_card(self.model))  # first: its reply is read below
        key = self.keys.worker(self.id)
        pipe.hset(key, mapping={k: json.dumps(v) for k, v in hb.model_dump().items()})
        pipe.pexpire(key, lease_ms)
        pipe.zadd(self.keys.workers(), {self.id: time.time() + self.settings.lease_s})
        pipe.sadd(self.keys.models(), self.model)
        held: dict[str, list[str]] = {}
        for c in [r.claim for r in self.running.values()] + self.waiting:
            held.setdefault(c.queue, []).append(c.entry_id)
        # Reset idle time: these entries have a live owner. Not after a lapsed lease: they may
        # have moved to another worker, and taking them back would hide them from its reclaim.
        if self.lease.held():
            for queue, ids in held.items():
                pipe.xclaim(queue, CONSUMER_GROUP, self.id, 0, ids, justid=True)
        card_exists, *_ = await pipe.execute()
        self.lease.beat_ok()
        if not card_exists:  # Redis lost it (restarted without its data): gateways need it
            await self._publish_card()

    async def _reclaim_loop(self) -> None:
        """Take over entries idle for a whole lease whose owner's heartbeat is gone."""
        while not self._closing:
            await asyncio.sleep(self.settings.heartbeat_s)
            if self._stopping.is_set() or not self.lease.reclaim_allowed():
                continue
            try:
                for queue in self.queues.values():
                    await self._reclaim(queue)
            except (RedisError, OSError) as exc:
                log.warning("reclaim failed", extra={"error": str(exc)})

    async def _reclaim(self, queue: str) -> None:
        free = self._free_slots()
        if free <= 0:
            return
        idle_ms = int(self.settings.lease_s * 1000)
        pending: list[dict[str, Any]] = await self.redis.xpending_range(
            queue, CONSUMER_GROUP, "-", "+", _RECLAIM_SCAN, idle=idle_ms
        )
        if not pending:
            return
        owners = sorted({str(p["consumer"]) for p in pending} - {self.id})
        pipe = self.redis.pipeline(transaction=False)
        for owner in owners:
            pipe.exists(self.keys.worker(owner))
        alive = {o for o, n in zip(owners, await pipe.execute(), strict=True) if n}
        held = {r.claim.entry_id for r in self.running.values()}
        held |= {c.entry_id for c in self.waiting}
        pairs = [(str(p["message_id"]), str(p["consumer"])) for p in pending]
        ids = reclaimable(pairs, self.id, held, alive)[:free]
        if not ids:
            return
        # XCLAIM re-checks the idle time: an owner that touched an entry meanwhile keeps it.
        reply = await self.redis.xclaim(queue, CONSUMER_GROUP, self.id, idle_ms, cast(Any, ids))
        for entry_id, fields in cast("list[tuple[str, dict[str, str] | None]]", reply):
            if fields:
                claim = Claim(entry_id, queue, fields["job"], int(fields.get("tokens", 0)))
                log.info("reclaimed job", extra={"job_id": claim.job_id, "worker_id": self.id})
                self.waiting.append(claim)
        self._room.set()


def _stream_items(reply: Any) -> list[tuple[str, list[tuple[str, dict[str, str]]]]]:
    """XREADGROUP's reply as (stream, entries) pairs, for RESP2 lists and RESP3 maps."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in reply.items()]
    return [(stream, entries) for stream, entries in reply]


def _seed_of(job_id: str) -> int:
    """A job without a seed samples from one fixed per job, so a retry continues the same text."""
    return int(job_id[:16], 16) if len(job_id) >= 16 else abs(hash(job_id))
