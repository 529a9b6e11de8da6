"""The claim phase: XREADGROUP from the model's queues while the engine has room, then START
each claim (one pipeline) and hand the started jobs to the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time

from redis.exceptions import RedisError, ResponseError

from shared import events
from shared.events import EVENT_FIELD, ErrorEvent, TokenEvent
from shared.keys import CONSUMER_GROUP, PRIORITIES, Priority
from shared.loops import LOOP_RESTART_S, REDIS_FAILURES, keep_running
from shared.records import JOB_ID, JobRecord, QueueEntry, RecordError
from shared.redisconn import is_transient
from shared.schemas import ErrorInfo, JobSpec
from shared.transitions import Exhausted, Started, StartReply
from worker import joblog
from worker.engine import EngineJob
from worker.entries import (
    ack,
    dead_letter,
    drop_malformed,
    ensure_groups,
    requeue,
    requeue_waiting,
)
from worker.jobstate import Claim, RunningJob
from worker.state import WorkerState

log = logging.getLogger(__name__)

RESERVE_SHARE = 4
"""The interactive reserve is at most 1/RESERVE_SHARE of a worker's slots."""

Sent = dict[str, tuple[list[int], list[str]]]
"""Per retried job: the token ids and text an earlier attempt already published."""


class Claimer:
    def __init__(self, st: WorkerState) -> None:
        self.st = st
        self._claims_since_batch = 0
        self._since_overflow: dict[Priority, int] = {p: 0 for p in PRIORITIES}

    async def loop(self) -> None:
        st = self.st

        async def step() -> None:
            if not st.lease.held():  # claims now could not be started: wait for a beat
                await asyncio.sleep(st.settings.heartbeat_s)
                return
            await self._start_waiting()
            free = st.free_slots()
            if free <= 0 or st.waiting:
                st.room.clear()
                await st.room.wait()
                return
            claims = await self._claim(free)
            if claims:
                st.waiting.extend(claims)
            if st.stopping.is_set():  # a read that SIGTERM overtook: give them back now
                await requeue_waiting(st)

        async def claim_failed(exc: Exception) -> None:
            if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                # Redis lost the group (restarted without AOF)
                with contextlib.suppress(*REDIS_FAILURES):
                    await ensure_groups(st)

        # The flag, not only cancellation: a client may swallow a cancel during a blocking read.
        await keep_running(
            step,
            failed="claim failed; retrying",
            log=log,
            every_s=0.0,
            redis=st.redis,
            retry_s=LOOP_RESTART_S,
            running=lambda: not st.stopping.is_set(),
            on_failure=claim_failed,
        )

    async def _claim(self, free: int) -> list[Claim]:
        """Take up to `free` entries, interactive first; block briefly when all are empty.

        Each priority has two lanes: its queue, and its overflow (owners past their fair
        share in flight). The queue goes first, except every `overflow_share`-th claim of a
        priority whose overflow has work, so a large owner's backlog still progresses. Batch
        work never takes the last `interactive_reserve` slots: an interactive job arriving
        into a full batch backlog starts at once instead of waiting for a batch job to end."""
        st = self.st
        batch_turn = self._claims_since_batch >= st.settings.batch_share
        order: tuple[Priority, ...] = ("batch", "interactive") if batch_turn else PRIORITIES
        batch_room = free - self._reserve()
        await self._release({"interactive": free, "batch": max(0, batch_room)})
        claims: list[Claim] = []
        for priority in order:
            budget = 1 if priority == "batch" and batch_turn else free - len(claims)
            if priority == "batch":
                budget = min(budget, batch_room)
            for lane, cap in self._lanes(priority):
                want = min(budget, free - len(claims), cap or free)
                if want > 0:
                    got = await self._read({lane: ">"}, want, block=None)
                    claims += got
                    budget -= len(got)
        if not claims:
            lanes = st.streams() if batch_room > 0 else self._interactive_lanes()
            streams = {k: ">" for k in lanes}
            claims = await self._read(streams, 1, block=st.settings.claim_block_ms)
        for c in claims:
            self._count(c)
        return claims

    async def _release(self, want: dict[Priority, int]) -> None:
        """Let the next jobs of token-fair scheduling into the queues this worker is about to
        read (gateway/admission.py, `fair_release` in shared/lua/prelude.lua): as many as it
        may claim of each priority. Nothing to do, and one round trip, when no owner waits."""
        st = self.st
        calls = [st.transitions.release(st.model, p, n) for p, n in want.items() if n > 0]
        if calls:
            await st.scripts.run_all(calls)

    def _reserve(self) -> int:
        """Slots kept from batch work: the setting, at most a quarter of the batch (a worker
        of one slot, an unpaged exllamav2, keeps none)."""
        st = self.st
        return min(st.settings.interactive_reserve, st.engine.max_batch // RESERVE_SHARE)

    def _interactive_lanes(self) -> list[str]:
        st = self.st
        return [st.placed["interactive"], st.queues["interactive"], st.overflow["interactive"]]

    def _lanes(self, priority: Priority) -> list[tuple[str, int | None]]:
        """(stream, most to take from it) in the order to read them: this worker's own lane
        first (jobs placed here for its cache, which no other worker takes before their
        steal deadline), then the queue and the overflow."""
        st = self.st
        queue, overflow, own = st.queues[priority], st.overflow[priority], st.placed[priority]
        if self._since_overflow[priority] >= st.settings.overflow_share:
            return [(own, None), (overflow, 1), (queue, None), (overflow, None)]
        return [(own, None), (queue, None), (overflow, None)]

    def _count(self, claim: Claim) -> None:
        st = self.st
        is_batch = claim.queue in (st.queues["batch"], st.overflow["batch"], st.placed["batch"])
        self._claims_since_batch = 0 if is_batch else self._claims_since_batch + 1
        priority: Priority = "batch" if is_batch else "interactive"
        from_overflow = claim.queue == st.overflow[priority]
        self._since_overflow[priority] = 0 if from_overflow else self._since_overflow[priority] + 1

    async def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[Claim]:
        reply = await self.st.redis.xreadgroup(
            CONSUMER_GROUP,
            self.st.id,
            streams,
            count=count,
            block=block,
        )
        claims: list[Claim] = []
        for queue, entries in reply or []:
            for entry_id, fields in entries:
                claim = await self._claim_of(queue, entry_id, fields)
                if claim is not None:
                    claims.append(claim)
        return claims

    async def _claim_of(self, queue: str, entry_id: str, fields: dict[str, str]) -> Claim | None:
        """The claim an entry makes; None for one that names no job (dead-lettered, acked)."""
        try:
            entry = QueueEntry.from_hash(fields or {})
        except RecordError as exc:
            await drop_malformed(self.st, queue, entry_id, str(exc))
            return None
        return Claim(entry_id, queue, entry.job, entry.tokens, entry.owner)

    async def _start_waiting(self) -> None:
        """START every waiting claim the engine has room for, in one pipeline."""
        st = self.st
        ready: list[Claim] = []
        active = len(st.running)
        while st.waiting and st.engine.fits(st.waiting[0].need_tokens, active + len(ready)):
            ready.append(st.waiting.pop(0))
        if not ready:
            return
        if not st.lease.held():
            # Paused or cut off for a whole lease: these entries may belong to another worker
            # now. Drop them; if they are still ours, the reclaim loop takes them back.
            log.warning("lease lapsed; dropping unstarted claims", extra={"claims": len(ready)})
            st.room.set()
            return
        try:
            replies, sent = await self._start(ready)
        except BaseException:
            st.waiting[:0] = ready  # START again later (a START that landed costs an attempt)
            raise
        await self._settle(ready, replies, sent)

    async def _start(self, ready: list[Claim]) -> tuple[list[StartReply | Exception], Sent]:
        """START each claim (one pipeline) and read what retried ones already sent."""
        st = self.st
        now = time.time()
        calls = [
            st.transitions.start(
                c.job_id, worker=st.id, now=now, max_attempts=st.settings.max_attempts
            )
            for c in ready
        ]
        # A START that Redis rejects (a damaged record) comes back in place and sets aside
        # that claim alone; connection errors still raise and every claim is tried again.
        replies = await st.scripts.run_all(calls)
        retried = [
            c.job_id
            for c, r in zip(ready, replies, strict=True)
            if isinstance(r, Started) and r.attempt > 1
        ]
        return replies, await self._sent_tokens(retried)

    async def _settle(
        self, ready: list[Claim], replies: list[StartReply | Exception], sent: Sent
    ) -> None:
        """Begin the STARTed jobs; ack the claims of jobs that had already ended. A failure
        here touches one claim only: an entry not acked stays pending and is reclaimed."""
        done_claims: list[Claim] = []
        for claim, reply in zip(ready, replies, strict=True):
            if isinstance(reply, Exception) and is_transient(reply):
                self.st.waiting.append(claim)  # START did not run: again once Redis takes it
                asyncio.get_running_loop().call_later(LOOP_RESTART_S, self.st.room.set)
                continue
            if isinstance(reply, Exception):
                # Left pending and not held: it is retried after a lease, costing only itself.
                log.error("START rejected", extra={"job_id": claim.job_id, "error": str(reply)})
                continue
            if isinstance(reply, Started):
                resumed = sent.get(claim.job_id, ([], []))
                try:
                    self._begin(claim, reply, resumed)
                except Exception as exc:  # e.g. a record that does not parse: fails alone
                    await self._give_up_start(claim, reply.attempt, exc)
                continue
            if isinstance(reply, Exhausted):
                with contextlib.suppress(RedisError, OSError):
                    await self._fail_exhausted(claim, reply)
            done_claims.append(claim)
        if done_claims:
            with contextlib.suppress(RedisError, OSError):
                await ack(self.st, done_claims)
        self.st.flush_wanted.set()

    async def _fail_exhausted(self, claim: Claim, seen: Exhausted) -> None:
        """A job out of attempts ends `failed` with an error event naming its last error, and
        goes to the dead letters."""
        st = self.st
        s = st.settings
        message = f"the job failed {s.max_attempts} attempts (GENQ_MAX_ATTEMPTS)"
        if seen.last_error:
            message += f"; last error: {seen.last_error}"
        seq = seen.last_seq + 1
        code = "max_attempts_exceeded"
        event = ErrorEvent(seq=seq, attempt=seen.attempt, code=code, message=message)
        call = st.transitions.settle(
            claim.job_id,
            status=seen.status,
            attempt=seen.attempt,
            last_seq=seen.last_seq,
            event=(seq, events.encode(event)),
            fields=JobRecord.fields(
                status="failed",
                finished_at=time.time(),
                error=ErrorInfo(code=code, message=message),
            ),
            maxlen=s.event_log_maxlen,
            retention_s=s.retention_s,
        )
        if await st.scripts.run(call):
            await dead_letter(st, claim, seen.attempt, message)

    async def _give_up_start(self, claim: Claim, attempt: int, exc: Exception) -> None:
        """A job that could not even begin: back to the queue as a failed attempt, so it is
        dead-lettered once they are spent instead of crashing the claim loop forever."""
        st = self.st
        log.error("could not begin job", extra={"job_id": claim.job_id, "error": str(exc)})
        st.forget(claim.job_id)
        error = f"the worker could not begin the job: {exc}"
        call = st.transitions.hand_back(
            claim.job_id, worker=st.id, attempt=attempt, counted=True, error=error
        )
        with contextlib.suppress(RedisError, OSError):
            if await st.scripts.run(call):
                await requeue(st, claim)
                joblog.requeued(st, claim, attempt, counted=True, why=error)

    async def _sent_tokens(self, job_ids: list[str]) -> Sent:
        """For retried jobs: the token ids and text an earlier attempt already published."""
        if not job_ids:
            return {}
        pipe = self.st.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xrange(self.st.keys.events(job_id))
        sent: Sent = {}
        for job_id, entries in zip(job_ids, await pipe.execute(), strict=True):
            ids: list[int] = []
            texts: list[str] = []
            for _, fields in entries:
                ev = events.decode(fields[EVENT_FIELD])
                if isinstance(ev, TokenEvent):
                    ids += ev.token_ids
                    texts.append(ev.text)
            sent[job_id] = (ids, texts)
        return sent

    def _begin(self, claim: Claim, started: Started, resumed: tuple[list[int], list[str]]) -> None:
        st = self.st
        spec = JobSpec.model_validate_json(started.spec)
        if spec.id != claim.job_id:
            raise ValueError(f"the record's spec is of another job ({spec.id[:40]!r})")
        run = RunningJob(
            spec=spec,
            claim=claim,
            attempt=started.attempt,
            seq=started.last_seq,
            started_wall=time.time(),
            resumed_ids=resumed[0],
            text_parts=list(resumed[1]),
        )
        st.running[spec.id] = run
        st.cache.touch([*spec.input_ids, *resumed[0]])  # prefilled now: cached from here on
        st.metrics.attempts.inc()
        st.dirty.add(spec.id)
        run.started(st.id)
        joblog.started(st, run)
        st.urgent.add(spec.id)  # `started` (and an end at once, if any) need not wait
        if started.cancel or spec.id in st.early_cancels:
            st.early_cancels.pop(spec.id, None)
            run.cancelled(started.cancel or "cancelled")
            return
        if spec.deadline is not None and time.time() > spec.deadline:
            run.fail("expired", "deadline_exceeded", "the job's timeout passed before it started")
            return
        seed = spec.sampling.seed if spec.sampling.seed is not None else seed_of(spec.id)
        assert st.runner is not None
        st.runner.add(
            EngineJob(
                id=spec.id,
                input_ids=spec.input_ids,
                max_tokens=spec.max_tokens,
                sampling=spec.sampling,
                seed=seed,
                resume_ids=resumed[0],
                grammar=spec.constraint.grammar if spec.constraint else None,
            ),
            started.attempt,
        )


def seed_of(job_id: str) -> int:
    """A job without a seed samples from one fixed per job id, the same in every process, so
    a retry (on any worker) continues the same text."""
    if JOB_ID.fullmatch(job_id):
        return int(job_id[:16], 16)
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "little")
