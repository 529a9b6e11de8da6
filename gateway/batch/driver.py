"""Each gateway's loop that moves batches on. Any gateway may drive any batch, one at a time:
the lease in Redis (`Keys.batch_lease`) names the one that does, and every step is safe to
run again, so a gateway that dies mid-step leaves work another one finishes.

A batch's steps, by status:

  validating   its input file is still there: `in_progress` (else `failed`)
  in_progress  queue the next chunk of lines (while fewer than GENQ_BATCH_MAX_IN_FLIGHT of its
               jobs are open); once every line has a result, `finalizing`; past its deadline,
               `finalizing` towards `expired`; without progress for GENQ_BATCH_SWEEP_S, sweep
               the open lines' jobs for ends the tracker missed
  cancelling / finalizing
               close every open line (its job's own end if it has one, else its job is
               cancelled and the line fails `batch_cancelled` / `batch_expired`), then write
               the files and the final status (finalize.py)
  ended        drop what only the running batch needed

The work of each step is elsewhere: queueing.py (a chunk into the queue), closing.py (the
sweep, and the open lines of a batch that ends early), finalize.py (the files, the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence

from redis.exceptions import RedisError

from gateway.batch.closing import Closer
from gateway.batch.finalize import Finalizer
from gateway.batch.lease import Lease, LeaseLost
from gateway.batch.queueing import Queuer
from gateway.batch.results import write_results
from gateway.batch.storage import FileStore
from gateway.state import GatewayState
from gateway.webhooks import batch_notify
from shared.batch_transitions import BatchTransitions
from shared.batches import ENDED_BATCH_STATUSES, BatchError, BatchRecord
from shared.loops import LOOP_RESTART_S, keep_running
from shared.transitions import ScriptRunner

log = logging.getLogger(__name__)

STEPS_PER_TURN = 16
"""Steps of one batch before the driver turns to the next (several batches share a gateway)."""


class BatchDriver:
    def __init__(self, state: GatewayState, store: FileStore, finalizer: Finalizer) -> None:
        self.state = state
        self.redis = state.redis
        self.keys = state.keys
        self.settings = state.settings
        self.scripts = ScriptRunner(state.redis)
        self.tx = BatchTransitions(state.keys)
        self.queuer = Queuer(state, store)
        self.closer = Closer(state, store)
        self.finalizer = finalizer
        self.token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._wake = asyncio.Event()
        self._progress: dict[str, tuple[int, float]] = {}
        self.closing = False

    def wake(self) -> None:
        """Look at the batches now (a new one, a cancel, results that may end one)."""
        self._wake.set()

    async def loop(self) -> None:
        async def step() -> None:
            self._wake.clear()
            if not await self.run_once():
                await self._idle()

        # The flag, not only cancellation: a client may turn a cancel into a RedisError.
        await keep_running(
            step,
            failed="batch driver: Redis failed; retrying",
            log=log,
            every_s=0.0,
            redis=self.redis,
            retry_s=LOOP_RESTART_S,
            running=lambda: not self.closing,
            on_failure=lambda exc: self._idle(),
        )

    async def _idle(self) -> None:
        """Wait for a wake, or `batch_poll_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.settings.batch_poll_s)

    async def run_once(self) -> bool:
        """One turn over the active batches; whether one of them has more to do right away."""
        busy = False
        for batch_id in await self.redis.zrange(self.keys.active_batches(), 0, -1):
            try:
                busy |= await self._drive(batch_id)
            except (RedisError, OSError):
                raise
            except Exception:  # a bug, a damaged record: that batch waits, the others go on
                log.exception("batch step failed", extra={"batch_id": batch_id})
        return busy

    async def _drive(self, batch_id: str) -> bool:
        lease = Lease(
            self.scripts, self.tx, batch_id, token=self.token, ttl_s=self.settings.batch_lease_s
        )
        if not await lease.hold():
            return False  # another gateway drives it
        try:
            for _ in range(STEPS_PER_TURN):
                record = await self._load(batch_id)
                if record is None:
                    await self.redis.zrem(self.keys.active_batches(), batch_id)
                    return False
                if not await self._step(record, lease):
                    return False
                await lease.renew()
            return True
        except LeaseLost:
            log.info("batch lease lost", extra={"batch_id": batch_id})
            return False
        finally:
            with contextlib.suppress(RedisError, OSError):
                await lease.free()

    async def _load(self, batch_id: str) -> BatchRecord | None:
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        return BatchRecord.from_hash(raw) if raw else None

    async def _step(self, record: BatchRecord, lease: Lease) -> bool:
        """One step of a batch; whether another can follow at once."""
        if record.status in ENDED_BATCH_STATUSES:
            if self.keys.cluster and batch_notify(self.settings) and not record.told:
                # its final status was set, and whoever set it stopped before the outbox
                # heard (a step after it on a cluster): tell it now
                await self.scripts.run(self.tx.retell(record.id, record.status))
            await self.finalizer.clean(record.id)
            self._progress.pop(record.id, None)
            return False
        if record.status == "validating":
            return await self._begin(record, lease)
        if record.status in ("cancelling", "finalizing"):
            await self._end(record, lease)
            return True
        return await self._advance(record, lease)

    async def _update(
        self, record: BatchRecord, lease: Lease, statuses: Sequence[str], **fields: object
    ) -> bool:
        call = self.tx.update(
            record.id,
            statuses=statuses,
            fields=BatchRecord.fields(**fields),
            lease_token=lease.token,
            notify=batch_notify(self.settings),
        )
        reply = await self.scripts.run(call)
        if reply.status == "lease":
            raise LeaseLost(record.id)
        return reply.done

    # ---- validating -----------------------------------------------------------------------

    async def _begin(self, record: BatchRecord, lease: Lease) -> bool:
        now = time.time()
        if not await self.redis.exists(self.keys.file(record.input_file_id)):
            error = BatchError(
                code="file_not_found",
                message=f"the input file '{record.input_file_id}' is gone (deleted or expired)",
                param="input_file_id",
            )
            await self._update(
                record, lease, ("validating",), status="failed", failed_at=now, errors=[error]
            )
            log.warning("batch failed: input file gone", extra={"batch_id": record.id})
            return True
        await self._update(record, lease, ("validating",), status="in_progress", in_progress_at=now)
        return True

    # ---- in progress ----------------------------------------------------------------------

    async def _advance(self, record: BatchRecord, lease: Lease) -> bool:
        s = self.settings
        now = time.time()
        queued_all = record.queued_chunks >= len(record.chunks)
        if now >= record.expires_at:
            log.info("batch expired", extra={"batch_id": record.id})
            ending = "expired"
        elif queued_all and record.resolved >= record.total:
            ending = "completed"
        else:
            open_jobs = record.lines_queued - record.resolved
            if not queued_all and open_jobs < s.batch_max_in_flight:
                await self._queue_chunk(record, lease)
                return True
            if self._sweep_due(record):
                await self.closer.close(record, lease, None)
            return False
        return await self._update(
            record, lease, ("in_progress",), status="finalizing", finalizing_at=now, ending=ending
        )

    def _sweep_due(self, record: BatchRecord) -> bool:
        """No line resolved for GENQ_BATCH_SWEEP_S, as this gateway has seen it."""
        now = time.monotonic()
        seen = self._progress.get(record.id)
        if seen is None or seen[0] != record.resolved:
            self._progress[record.id] = (record.resolved, now)
            return False
        if now - seen[1] < self.settings.batch_sweep_s:
            return False
        self._progress[record.id] = (record.resolved, now)
        # Routine, not a fault: a batch of long lines resolves none for minutes. The sweep
        # finds out; what it finds wrong (a lost job) is logged where it is found.
        log.debug(
            "batch sweep: looking at its open lines' jobs",
            extra={"batch_id": record.id, "quiet_s": self.settings.batch_sweep_s},
        )
        return True

    async def _queue_chunk(self, record: BatchRecord, lease: Lease) -> None:
        """The next chunk queued, its refused lines failed, then the cursor moved on."""
        failed = await self.queuer.queue(record, lease)
        if failed:
            await write_results(self.scripts, self.tx, record.id, failed, self.settings)
        await self._update(record, lease, ("in_progress",), queued_chunks=record.queued_chunks + 1)

    # ---- the end --------------------------------------------------------------------------

    async def _end(self, record: BatchRecord, lease: Lease) -> None:
        ending = record.ending or "completed"
        if record.resolved < record.total:
            await self.closer.close(record, lease, None if ending == "completed" else ending)
            fresh = await self._load(record.id)
            if fresh is None or fresh.resolved < fresh.total:
                return  # lines still open (a job not ended yet): the next turn goes on
            record = fresh
        await self.finalizer.run(record, lease)
