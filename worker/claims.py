"""The claim phase: XREADGROUP from the model's queues while the engine has room, then START
each claim (one pipeline) and hand the started jobs to the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import logging
import time
from collections import Counter

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from shared import events
from shared.events import EVENT_FIELD, ErrorEvent, TokenEvent
from shared.keys import CONSUMER_GROUP, PRIORITIES, Priority
from shared.loops import LOOP_RESTART_S, REDIS_FAILURES, keep_running
from shared.pages import PAGE_TOKENS
from shared.records import JOB_ID, JobRecord, QueueEntry, RecordError
from shared.redisconn import is_cluster, is_transient
from shared.schemas import ErrorInfo, JobSpec
from shared.transitions import Exhausted, Interrupted, Started, StartReply
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

CLUSTER_BLOCK_MS = 100
"""A worker's blocking read of one queue shard on a cluster (then the next shard's)."""

log = logging.getLogger(__name__)

DOORSTEP_WAVES = 2
"""Batch claims started ahead of their slots: at most this many batch slots' worth."""

UNBLOCK_RETRY_S = 0.002
"""How soon to send CLIENT UNBLOCK again when the blocking read had not reached Redis yet."""

RESERVE_SHARE = 4
"""The interactive reserve is at most 1/RESERVE_SHARE of a worker's slots."""

OWNER_POLL_S = 0.01
"""While an owner fills all but the owner reserve, how often a worker without room looks for
other owners' jobs in token-fair scheduling (one script call)."""

INTERRUPTED_CODE = "interrupted"
"""The error of a job failed for being interrupted by more stops than GENQ_MAX_INTERRUPTIONS."""

Sent = dict[str, tuple[list[int], list[str]]]


class OwnerLimits:
    """How many slots each owner holds in the engine, and how many one may: while another
    owner's jobs came to this worker lately, an owner holding `cap` (the batch less the owner
    reserve, GENQ_OWNER_RESERVE) leaves the rest to the others, so their next job starts at
    once instead of when one of its slots comes free. Once the others hold the reserve
    between them (backlogged too), token-fair order alone decides."""

    def __init__(self, held: Counter[str], cap: int, reserve: int, seen: set[str]) -> None:
        self.held = held
        self.cap = cap
        self.reserve = reserve
        self.seen = seen
        """The owners whose jobs started here lately (GENQ_OWNER_RESERVE_WINDOW_S)."""

    def _full(self, owner: str) -> bool:
        mine = self.held[owner]
        if mine < self.cap or not self.seen - {owner}:  # no other owner came lately
            return False
        return sum(self.held.values()) - mine < self.reserve

    def capped(self) -> set[str]:
        return {o for o in self.held if self._full(o)}

    def allows(self, claim: Claim) -> bool:
        return claim.owner is None or not self._full(claim.owner)


"""Per retried job: the token ids and text an earlier attempt already published."""


class Claimer:
    def __init__(self, st: WorkerState) -> None:
        self.st = st
        self._claims_since_batch = 0
        self._since_overflow: dict[Priority, int] = {p: 0 for p in PRIORITIES}
        self._can_unblock = True
        self._owners_seen: dict[str, float] = {}
        """Owner → when a job of theirs last started here (monotonic)."""
        self._paged_out = False
        """The claim at the front of `waiting` does not fit the engine's free pages: no more
        claims until a slot (and its pages) comes free."""

    async def loop(self) -> None:
        st = self.st
        # The connection of the blocking reads that a slot coming free must end early (one
        # that sees the interactive lanes alone): CLIENT UNBLOCK needs its id.
        if is_cluster(st.redis):  # no single connection to unblock: reads end at their time
            self._blocker, self._can_unblock = st.redis, False
        else:
            self._blocker = st.redis.client()
        try:
            await self._loop()
        finally:
            with contextlib.suppress(RedisError, OSError):
                if self._blocker is not st.redis:
                    await self._blocker.aclose()

    async def _loop(self) -> None:
        st = self.st

        async def step() -> None:
            if not st.lease.held():  # claims now could not be started: wait for a beat
                await asyncio.sleep(st.settings.heartbeat_s)
                return
            await self._start_waiting()
            st.room.clear()  # set again by whatever frees a slot from here on
            free = st.free_slots()
            limits = self._owner_limits()
            capped = limits.capped() if limits is not None else set()
            # A capped owner's claims wait here for its cap to lift: they hold no slot from
            # the others (counted, the reserve's slots looked taken, and another owner's job
            # waited for one of the capped owner's to end).
            if capped:
                free += sum(1 for c in st.waiting if c.owner in capped)
            ahead = self._ahead()
            if self._paged_out or (free <= 0 and free + ahead - self._reserve() <= 0):
                await st.room.wait()  # no slot, or no pages for the claim at the front
                return
            if capped:
                claims = await self._claim_for_others(free, capped)
            else:
                claims = await self._claim(free, ahead)
            batch = [c for c in claims if self._is_batch(c)]
            st.waiting[:0] = [c for c in claims if not self._is_batch(c)]
            st.waiting.extend(batch)
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

    async def _claim(self, free: int, ahead: int = 0) -> list[Claim]:
        """Take up to `free` entries, interactive first; block briefly when all are empty.
        Batch work may take `ahead` more: claims that wait for the slots of jobs about to
        end, so that they start as those end instead of a read later.

        Each priority has two lanes: its queue, and its overflow (owners past their fair
        share in flight). The queue goes first, except every `overflow_share`-th claim of a
        priority whose overflow has work, so a large owner's backlog still progresses. Batch
        work never takes the last `interactive_reserve` slots: an interactive job arriving
        into a full batch backlog starts at once instead of waiting for a batch job to end."""
        st = self.st
        st.next_shard()
        batch_turn = self._claims_since_batch >= st.settings.batch_share
        order: tuple[Priority, ...] = ("batch", "interactive") if batch_turn else PRIORITIES
        batch_room = free + ahead - self._reserve()
        await self._release({"interactive": max(0, free), "batch": max(0, batch_room)})
        claims: list[Claim] = []
        for priority in order:
            if priority == "batch":
                room = min(free + ahead - len(claims), batch_room)
            else:
                room = free - len(claims)
            budget = min(1, room) if priority == "batch" and batch_turn else room
            for lane, cap in self._lanes(priority):
                if st.room.is_set() and st.waiting:
                    break  # slots came free for claims already waiting: START those first
                want = min(budget, cap or budget)
                if want > 0:
                    got = await self._read({lane: ">"}, want, block=None)
                    claims += got
                    budget -= len(got)
        if st.room.is_set() and st.waiting:
            pass
        elif not claims and free > 0 and batch_room > 0 and not st.waiting:
            # Free slots and nothing waiting: only new work can change anything.
            streams = {k: ">" for k in st.streams()}
            claims = await self._read(streams, 1, block=self._block_ms())
        elif not claims:
            # Claims waiting, or no free slot (this read was for batch work taken ahead): a
            # slot coming free must end it, or the next interactive job, which token-fair
            # scheduling lets into the queue only for a free slot, waits out the whole read.
            lanes = st.streams() if batch_room > 0 else self._interactive_lanes()
            claims = await self._read_until_room(lanes)
        for c in claims:
            self._count(c)
        return claims

    async def _claim_for_others(self, free: int, capped: set[str]) -> list[Claim]:
        """While the owner at the top of the batch is `capped` (`OwnerLimits`): the other
        owners' jobs alone, up to `free`, taken out of token-fair turn into this worker's own
        lanes and read from there (the shared queue, which may hold the capped owner's next
        jobs ahead of theirs, waits for the cap to lift). Nothing there: look again after
        OWNER_POLL_S, or as soon as a slot comes free."""
        st = self.st
        want: dict[Priority, int] = {"interactive": free, "batch": free - self._reserve()}
        await self._release(want, capped)
        claims: list[Claim] = []
        for priority in PRIORITIES:
            room = min(want[priority], free - len(claims))
            if room > 0:
                claims += await self._read({st.placed[priority]: ">"}, room, block=None)
        if not claims:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(st.room.wait(), OWNER_POLL_S)
        for c in claims:
            self._count(c)
        return claims

    async def _release(self, want: dict[Priority, int], capped: set[str] | None = None) -> None:
        """Let the next jobs of token-fair scheduling into the queues this worker is about to
        read (gateway/admission.py, `fair_release` in shared/lua/prelude.lua): as many as it
        may claim of each priority. With owners `capped`, none of theirs, into this worker's
        own lanes. Nothing to do, and one round trip, when no owner waits."""
        st = self.st
        calls = [
            st.transitions.release(
                st.model, p, n, skip=capped or (), lane=st.placed[p], shard=st.shard
            )
            for p, n in want.items()
            if n > 0
        ]
        if calls:
            await st.scripts.run_all(calls)

    async def _read_until_room(self, lanes: list[str]) -> list[Claim]:
        """Block on `lanes` until a job comes, or until a slot comes free: claims waiting for
        one, or batch work kept from the interactive reserve, may then start at once, not at
        the end of the blocking read. The read is ended by CLIENT UNBLOCK (as a timeout: an
        entry it took is never lost), on a connection of its own."""
        st = self.st
        blocker = self._blocker
        streams = {k: ">" for k in lanes}
        client_id = await self._blocker_id()
        if client_id is None:  # CLIENT not allowed here (an ACL, a managed Redis): as before
            return await self._read(streams, 1, block=self._block_ms())
        read = asyncio.ensure_future(self._read(streams, 1, block=self._block_ms(), redis=blocker))
        room = asyncio.ensure_future(st.room.wait())
        try:
            await asyncio.wait({read, room}, return_when=asyncio.FIRST_COMPLETED)
            # A slot came free: end the read. It may not have reached Redis yet (UNBLOCK
            # answers 0): again shortly, until the read has returned.
            while not read.done():
                try:
                    if await st.redis.client_unblock(client_id):
                        break
                except ResponseError:  # UNBLOCK refused: reads end at their timeout from now
                    self._can_unblock = False
                    break
                except (RedisError, OSError):
                    break  # the read ends at its own timeout
                await asyncio.wait({read}, timeout=UNBLOCK_RETRY_S)
            return await read
        finally:
            room.cancel()
            if not read.done():
                read.cancel()

    async def _blocker_id(self) -> int | None:
        """The blocking connection's CLIENT ID, or None where CLIENT ID / UNBLOCK are refused
        (then blocking reads end at their timeout, GENQ_CLAIM_BLOCK_MS, as they used to)."""
        if not self._can_unblock:
            return None
        try:
            return int(await self._blocker.client_id())
        except ResponseError as exc:
            self._can_unblock = False
            log.warning(
                "CLIENT ID refused; slots freed during a blocking claim wait for its timeout",
                extra={"error": str(exc)},
            )
            return None

    def _ahead(self) -> int:
        """Batch claims worth taking before their slots are free: one per job in the engine
        within `WorkerState.ahead_tokens` of its max_tokens (it ends within that many steps,
        or sooner; worker/lead.py).
        None without an interactive reserve: there a slot coming free is the next
        interactive job's, if one comes, not a batch job's taken ahead."""
        reserve = self._reserve()
        if not reserve:
            return 0
        st = self.st
        near = st.ahead_tokens() + st.lead.start_steps(st.engine.times.recent_s)
        # Slots that free within `near` steps (the lead, and the next group's START): each
        # job in the engine frees one when its tokens are made; a claim started ahead waits
        # at the doorstep (all its tokens left) and takes the first slot to free, freeing it
        # again if it ends within `near` too.
        # (Counting the doorstep's jobs as in the engine let each start ahead allow one more:
        # with tiny jobs, thousands started ahead.) The engine holds the oldest started jobs,
        # up to its batch slots, and any that made a token.
        batch_slots = st.engine.max_batch - reserve
        frees: list[int] = []
        doorstep: list[int] = []
        for r in st.running.values():
            if r.end is not None or r.retry_error is not None:
                continue
            if r.first_token_wall is not None or len(frees) < batch_slots:
                frees.append(r.tokens_left())
            else:
                doorstep.append(r.tokens_left())
        heapq.heapify(frees)
        ending = 0
        for left in doorstep:
            if not frees or frees[0] > near:
                break
            ending += 1
            heapq.heapreplace(frees, frees[0] + left)
        return min(DOORSTEP_WAVES * batch_slots, ending + sum(1 for t in frees if t <= near))

    def _block_ms(self) -> int:
        """How long a blocking read waits. On a cluster it reads one shard and cannot be
        unblocked when a slot comes free, so it waits briefly and the next read moves on to
        the next shard."""
        block = self.st.settings.claim_block_ms
        return min(block, CLUSTER_BLOCK_MS) if self.st.keys.cluster else block

    def _is_batch(self, claim: Claim) -> bool:
        st = self.st
        if st.keys.shards > 1:  # a claim read from another shard than the current one
            k, model, shard = st.keys, st.model, st.keys.shard_of(claim.job_id)
            batch = (k.queue(model, "batch", shard), k.overflow(model, "batch", shard))
            return claim.queue in (*batch, k.placed(model, "batch", st.id, shard))
        return claim.queue in (st.queues["batch"], st.overflow["batch"], st.placed["batch"])

    def _reserve(self) -> int:
        """Slots kept from batch work: the setting, at most a quarter of the batch (a worker
        of one slot, an unpaged exllamav2, keeps none)."""
        st = self.st
        return min(st.settings.interactive_reserve, st.engine.max_batch // RESERVE_SHARE)

    def _owner_reserve(self) -> int:
        """Slots the owner filling this worker leaves for others (at most a quarter)."""
        st = self.st
        return min(st.settings.owner_reserve, st.engine.max_batch // RESERVE_SHARE)

    def _owner_limits(self) -> OwnerLimits | None:
        """Each owner's slots in the engine and the most one may hold, while another owner's
        jobs started here within GENQ_OWNER_RESERVE_WINDOW_S; None otherwise (no owner's job
        started lately, or the reserve off): nothing is held back. One owner's jobs alone are
        never held back: the cap is for an owner other than the one that came lately."""
        st = self.st
        reserve = self._owner_reserve()
        if not reserve or not self._owners_seen:
            return None
        since = time.monotonic() - st.settings.owner_reserve_window_s
        for owner in [o for o, t in self._owners_seen.items() if t < since]:
            del self._owners_seen[owner]
        if not self._owners_seen:
            return None
        held = Counter(
            r.claim.owner
            for r in st.running.values()
            if r.end is None and r.retry_error is None and r.claim.owner is not None
        )
        # (an empty engine too: the first owner read into it may not take the reserve)
        return OwnerLimits(held, st.engine.max_batch - reserve, reserve, set(self._owners_seen))

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
        is_batch = self._is_batch(claim)
        self._claims_since_batch = 0 if is_batch else self._claims_since_batch + 1
        priority: Priority = "batch" if is_batch else "interactive"
        from_overflow = claim.queue == st.overflow[priority]
        self._since_overflow[priority] = 0 if from_overflow else self._since_overflow[priority] + 1

    async def _read(
        self,
        streams: dict[str, str],
        count: int,
        block: int | None,
        redis: aioredis.Redis | None = None,
    ) -> list[Claim]:
        began = time.monotonic()
        reply = await (redis or self.st.redis).xreadgroup(
            CONSUMER_GROUP,
            self.st.id,
            streams,
            count=count,
            block=block,
        )
        if block is None:  # a blocking read's time is the queue's, not the way in
            self.st.lead.read(time.monotonic() - began)
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
        """START every waiting claim the engine has room for, in one pipeline, in order; batch
        claims (taken ahead of their slots) leave the interactive reserve free.

        Batch claims may start ahead of their slots, one per job within `ahead_tokens` of its
        end: they wait at the engine's doorstep (worker/core.py) and join it at the step that
        frees a slot, instead of a Redis round trip and a socket hop after it. Only beside an
        interactive reserve (which batch jobs never join, so an interactive job finds a slot
        there) and while no interactive claim waits here: interactive work goes first."""
        st = self.st
        ready: list[Claim] = []
        running = [r for r in st.running.values() if r.end is None and r.retry_error is None]
        batch_slots = st.engine.max_batch - self._reserve()
        batch = sum(1 for r in running if self._is_batch(r.claim))
        others = len(running) - batch
        ahead = self._ahead() if all(self._is_batch(c) for c in st.waiting) else 0
        limits = self._owner_limits()
        kept: list[Claim] = []
        self._paged_out = False
        for i, claim in enumerate(st.waiting):
            is_batch = self._is_batch(claim)
            if is_batch and others + batch >= batch_slots + ahead:
                kept.append(claim)
            elif limits is not None and not limits.allows(claim):
                kept.append(claim)  # its owner holds all but the owner reserve already
            elif (
                st.engine.fits(claim.need_tokens, others + batch, batch_slots + ahead)
                if is_batch  # below, the engine's own slots: batch jobs past theirs wait outside
                else st.engine.fits(claim.need_tokens, others + min(batch, batch_slots))
            ):
                ready.append(claim)
                batch += is_batch
                others += not is_batch
                if limits is not None and claim.owner is not None:
                    limits.held[claim.owner] += 1
            else:  # no pages for it: what follows waits behind it
                kept += st.waiting[i:]
                self._paged_out = True
                break
        if not ready:
            return
        st.waiting[:] = kept
        if self._owner_reserve():
            now = time.monotonic()
            for claim in ready:
                if claim.owner is not None:
                    self._owners_seen[claim.owner] = now
        if not st.lease.held():
            # Paused or cut off for a whole lease: these entries may belong to another worker
            # now. Drop them; if they are still ours, the reclaim loop takes them back.
            log.warning("lease lapsed; dropping unstarted claims", extra={"claims": len(ready)})
            st.room.set()
            return
        began = time.monotonic()
        try:
            replies, sent = await self._start(ready)
        except BaseException:
            st.waiting[:0] = ready  # START again later (a START that landed costs an attempt)
            raise
        await self._settle(ready, replies, sent)
        st.lead.started(time.monotonic() - began)

    async def _start(self, ready: list[Claim]) -> tuple[list[StartReply | Exception], Sent]:
        """START each claim (one pipeline) and read what retried ones already sent."""
        st = self.st
        now = time.time()
        calls = [
            st.transitions.start(
                c.job_id,
                worker=st.id,
                now=now,
                max_attempts=st.settings.max_attempts,
                max_interruptions=st.settings.max_interruptions,
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
            if isinstance(reply, Exhausted | Interrupted):
                with contextlib.suppress(RedisError, OSError):
                    await self._fail_exhausted(claim, reply)
            done_claims.append(claim)
        if done_claims:
            with contextlib.suppress(RedisError, OSError):
                await ack(self.st, done_claims)
        self.st.flush_wanted.set()

    async def _fail_exhausted(self, claim: Claim, seen: Exhausted | Interrupted) -> None:
        """A job out of attempts (or interrupted too often) ends `failed` with an error event
        that says so (naming its last error), and goes to the dead letters."""
        st = self.st
        s = st.settings
        if isinstance(seen, Interrupted):
            code = INTERRUPTED_CODE
            message = (
                f"the job was interrupted by {seen.interruptions} stops of the server before it "
                f"could finish (more than GENQ_MAX_INTERRUPTIONS, {s.max_interruptions}); "
                f"GET /v1/jobs/{claim.job_id} has its text so far"
            )
        else:
            code = "max_attempts_exceeded"
            message = f"the job failed {s.max_attempts} attempts (GENQ_MAX_ATTEMPTS)"
            if seen.last_error:
                message += f"; last error: {seen.last_error}"
        seq = seen.last_seq + 1
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
        st.metrics.attempts.inc()
        st.dirty.add(spec.id)
        run.started(st.id)
        joblog.started(st, run)
        # `started` goes with the next flush (with the first tokens, under load: one write
        # less per job); an end at once need not wait.
        if started.cancel or spec.id in st.early_cancels:
            st.early_cancels.pop(spec.id, None)
            run.cancelled(started.cancel or "cancelled")
            st.urgent.add(spec.id)
            return
        if spec.deadline is not None and time.time() > spec.deadline:
            run.fail("expired", "deadline_exceeded", "the job's timeout passed before it started")
            st.urgent.add(spec.id)
            return
        seed = spec.sampling.seed if spec.sampling.seed is not None else seed_of(spec.id)
        # a batch job joins the engine only beside fewer than the batch slots' jobs
        limit = st.engine.max_batch - self._reserve() if self._is_batch(claim) else 0
        assert st.runner is not None
        prompt = [*spec.input_ids, *resumed[0]]
        hit = st.cache.touch(prompt)  # prefilled now: cached from here on
        st.pace.started(spec.id, max(0, len(prompt) - hit * PAGE_TOKENS))
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
            limit,
        )


def seed_of(job_id: str) -> int:
    """A job without a seed samples from one fixed per job id, the same in every process, so
    a retry (on any worker) continues the same text."""
    if JOB_ID.fullmatch(job_id):
        return int(job_id[:16], 16)
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "little")
