"""The claim phase: XREADGROUP from the model's queues while the engine has room, then START
each claim (one pipeline) and hand the started jobs to the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from redis.exceptions import RedisError, ResponseError

from shared.keys import CONSUMER_GROUP, PRIORITIES, Priority
from shared.schemas import JobSpec
from worker.engine import EngineJob
from worker.entries import ack, dead_letter, ensure_groups, requeue, requeue_waiting
from worker.jobstate import Claim, RunningJob
from worker.state import LOOP_RESTART_S, WorkerState

log = logging.getLogger(__name__)

Sent = dict[str, tuple[list[int], list[str]]]
"""Per retried job: the token ids and text an earlier attempt already published."""


class Claimer:
    def __init__(self, st: WorkerState) -> None:
        self.st = st
        self._claims_since_batch = 0

    async def loop(self) -> None:
        st = self.st
        # The flag, not only cancellation: a client may swallow a cancel during a blocking read.
        while not st.stopping.is_set():
            try:
                if not st.lease.held():  # claims now could not be started: wait for a beat
                    await asyncio.sleep(st.settings.heartbeat_s)
                    continue
                await self._start_waiting()
                free = st.free_slots()
                if free <= 0 or st.waiting:
                    st.room.clear()
                    await st.room.wait()
                    continue
                claims = await self._claim(free)
                if claims:
                    st.waiting.extend(claims)
                if st.stopping.is_set():  # a read that SIGTERM overtook: give them back now
                    await requeue_waiting(st)
            except asyncio.CancelledError:
                raise
            except ResponseError as exc:
                log.warning("claim failed; retrying", extra={"error": str(exc)})
                if "NOGROUP" in str(exc):  # Redis lost the group (restarted without AOF)
                    with contextlib.suppress(RedisError, OSError):
                        await ensure_groups(st)
                await asyncio.sleep(LOOP_RESTART_S)
            except (RedisError, OSError) as exc:
                log.warning("claim failed; retrying", extra={"error": str(exc)})
                await asyncio.sleep(LOOP_RESTART_S)

    async def _claim(self, free: int) -> list[Claim]:
        """Take up to `free` entries, interactive first; block briefly when both are empty."""
        queues = self.st.queues
        batch_turn = self._claims_since_batch >= self.st.settings.batch_share
        order: tuple[Priority, ...] = ("batch", "interactive") if batch_turn else PRIORITIES
        claims: list[Claim] = []
        for priority in order:
            want = 1 if priority == "batch" and batch_turn else free - len(claims)
            if want > 0:
                claims += await self._read({queues[priority]: ">"}, want, block=None)
        if not claims:
            streams = {k: ">" for k in queues.values()}
            claims = await self._read(streams, 1, block=self.st.settings.claim_block_ms)
        for c in claims:
            is_batch = c.queue == queues["batch"]
            self._claims_since_batch = 0 if is_batch else self._claims_since_batch + 1
        return claims

    async def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[Claim]:
        reply = await self.st.redis.xreadgroup(
            CONSUMER_GROUP,
            self.st.id,
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

    async def _start(self, ready: list[Claim]) -> tuple[list[Any], Sent]:
        """START each claim (one pipeline) and read what retried ones already sent."""
        st = self.st
        s = st.settings
        now = repr(time.time())
        pipe = st.redis.pipeline(transaction=False)
        for c in ready:
            await st.scripts.start(
                keys=st.job_keys(c.job_id),
                args=[st.id, now, s.max_attempts, s.retention_s, s.event_log_maxlen],
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

    async def _settle(self, ready: list[Claim], replies: list[Any], sent: Sent) -> None:
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
                    await dead_letter(self.st, claim, int(reply[1]))
            done_claims.append(claim)
        if done_claims:
            with contextlib.suppress(RedisError, OSError):
                await ack(self.st, done_claims)
        self.st.flush_wanted.set()

    async def _give_up_start(self, claim: Claim, attempt: int, exc: Exception) -> None:
        """A job that could not even begin: back to the queue as a failed attempt, so it is
        dead-lettered once they are spent instead of crashing the claim loop forever."""
        st = self.st
        log.error("could not begin job", extra={"job_id": claim.job_id, "error": str(exc)})
        st.forget(claim.job_id)
        error = f"the worker could not begin the job: {exc}"
        with contextlib.suppress(RedisError, OSError):
            reply = await st.scripts.hand_back(
                keys=[st.keys.job(claim.job_id)], args=[st.id, str(attempt), "1", error]
            )
            if reply:
                await requeue(st, claim)

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
        st = self.st
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
        st.running[spec.id] = run
        st.dirty.add(spec.id)
        run.started(st.id)
        st.urgent.add(spec.id)  # `started` (and an end at once, if any) need not wait
        if cancel or spec.id in st.early_cancels:
            st.early_cancels.pop(spec.id, None)
            run.cancelled(cancel or "cancelled")
            return
        if spec.deadline is not None and time.time() > spec.deadline:
            run.fail("expired", "deadline_exceeded", "the job's timeout passed before it started")
            return
        seed = spec.sampling.seed if spec.sampling.seed is not None else _seed_of(spec.id)
        assert st.runner is not None
        st.runner.add(
            EngineJob(
                id=spec.id,
                input_ids=spec.input_ids,
                max_tokens=spec.max_tokens,
                sampling=spec.sampling,
                seed=seed,
                resume_ids=resumed[0],
            )
        )


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
