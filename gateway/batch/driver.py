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

Queueing a chunk is idempotent: each line's job is created by a SUBMIT that also claims the
line's key, so a chunk queued twice (a driver that died before moving the cursor) makes no
job twice. Within a chunk, lines are queued sorted by their prompt's tokens: lines sharing a
prefix (a system prompt) reach the engine together, and its prefix cache shares their pages.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from itertools import accumulate

from redis.exceptions import RedisError

from gateway.batch.finalize import Finalizer
from gateway.batch.lines import LineChecker, LineProblem, PreparedLine, custom_id_of
from gateway.batch.results import BatchJob, error_line, read_logs, result_of
from gateway.batch.storage import FileStore
from gateway.state import GatewayState
from shared.batch_transitions import BatchTransitions, LineResult
from shared.batches import (
    CANCELLED_CODE,
    CANCELLED_MESSAGE,
    ENDED_BATCH_STATUSES,
    EXPIRED_CODE,
    EXPIRED_MESSAGE,
    BatchError,
    BatchRecord,
    batch_job_id,
)
from shared.events import EventError
from shared.records import JobRecord, RecordError
from shared.transitions import ScriptRunner

log = logging.getLogger(__name__)

CHECK_GROUP = 128
"""Lines checked between two yields to the event loop."""
SUBMIT_PIPELINE = 100
"""SUBMITs per pipeline."""
SWEEP_RANGE = 1000
"""Lines looked at per round of a sweep."""
STEPS_PER_TURN = 16
"""Steps of one batch before the driver turns to the next (several batches share a gateway)."""
CLAIM_MARGIN_S = 3600
"""A line's claim outlives the batch's deadline by this much (no chunk is queued later)."""
LOOP_RESTART_S = 0.5


class LeaseLost(Exception):
    """Another gateway drives the batch now: stop this step (what it did is safe)."""


class Lease:
    def __init__(self, driver: BatchDriver, batch_id: str) -> None:
        self._driver = driver
        self.batch_id = batch_id
        self.token = driver.token

    async def hold(self) -> bool:
        d = self._driver
        ttl_ms = int(d.settings.batch_lease_s * 1000)
        return await d.scripts.run(d.tx.hold(self.batch_id, token=self.token, ttl_ms=ttl_ms))

    async def renew(self) -> None:
        if not await self.hold():
            raise LeaseLost(self.batch_id)

    async def free(self) -> None:
        d = self._driver
        await d.scripts.run(d.tx.free(self.batch_id, token=self.token))


class InputLines:
    """A batch's input lines by number, read a chunk at a time from the file store."""

    def __init__(self, store: FileStore, record: BatchRecord) -> None:
        self._store = store
        self._file = record.input_file_id
        self._ends = list(accumulate(record.chunks))
        self._cache: tuple[int, list[bytes] | None] | None = None

    async def chunk(self, index: int) -> list[bytes] | None:
        """The raw lines of chunk `index` (without newlines); None if the file is gone."""
        if self._cache is not None and self._cache[0] == index:
            return self._cache[1]
        data = await self._store.chunk(self._file, index)
        lines = None if data is None else [x.rstrip(b"\r") for x in data.split(b"\n")]
        self._cache = (index, lines)
        return lines

    async def line(self, n: int) -> bytes | None:
        index = bisect.bisect_left(self._ends, n)
        lines = await self.chunk(index)
        first = self._ends[index - 1] + 1 if index else 1
        return None if lines is None else lines[n - first]


class BatchDriver:
    def __init__(self, state: GatewayState, store: FileStore, finalizer: Finalizer) -> None:
        self.state = state
        self.redis = state.redis
        self.keys = state.keys
        self.settings = state.settings
        self.store = store
        self.scripts = ScriptRunner(state.redis)
        self.tx = BatchTransitions(state.keys)
        self.checker = LineChecker(state)
        self.finalizer = finalizer
        self.token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._wake = asyncio.Event()
        self._progress: dict[str, tuple[int, float]] = {}
        self.closing = False

    def wake(self) -> None:
        """Look at the batches now (a new one, a cancel, results that may end one)."""
        self._wake.set()

    async def loop(self) -> None:
        # The flag, not only cancellation: a client may turn a cancel into a RedisError.
        while not self.closing:
            self._wake.clear()
            busy = False
            try:
                busy = await self.run_once()
            except (RedisError, OSError) as exc:
                log.warning("batch driver: Redis failed; retrying", extra={"error": str(exc)})
                await asyncio.sleep(LOOP_RESTART_S)
            if not busy:
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
        lease = Lease(self, batch_id)
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
            if self._stalled(record):
                await self._close_lines(record, lease, None)
            return False
        return await self._update(
            record, lease, ("in_progress",), status="finalizing", finalizing_at=now, ending=ending
        )

    def _stalled(self, record: BatchRecord) -> bool:
        """No line resolved for GENQ_BATCH_SWEEP_S, as this gateway has seen it."""
        now = time.monotonic()
        seen = self._progress.get(record.id)
        if seen is None or seen[0] != record.resolved:
            self._progress[record.id] = (record.resolved, now)
            return False
        if now - seen[1] < self.settings.batch_sweep_s:
            return False
        self._progress[record.id] = (record.resolved, now)
        log.info("batch stalled: sweeping its open lines", extra={"batch_id": record.id})
        return True

    async def _queue_chunk(self, record: BatchRecord, lease: Lease) -> None:
        """Queue the lines of the next chunk; lines that cannot run get their error now."""
        index = record.queued_chunks
        first = sum(record.chunks[:index]) + 1
        raws = await InputLines(self.store, record).chunk(index)
        last = min(first + record.chunks[index], record.total + 1)  # trailing blanks: none
        prepared: list[PreparedLine] = []
        failed: list[LineResult] = []
        for n in range(first, last):
            if raws is None:
                failed.append(_gone(record.id, n))
                continue
            raw = raws[n - first]
            checked = await self.checker.check(n, raw)
            if isinstance(checked, LineProblem):
                failed.append(_refused(record.id, checked, custom_id_of(raw)))
            else:
                prepared.append(checked)
            if (n - first) % CHECK_GROUP == CHECK_GROUP - 1:
                await asyncio.sleep(0)  # tokenizing is CPU work: let the loop serve others
        await self._submit(record, sorted(prepared, key=lambda p: p.spec.input_ids))
        await lease.renew()
        if failed:
            await self._write(record.id, failed)
        await self._update(record, lease, ("in_progress",), queued_chunks=index + 1)

    async def _submit(self, record: BatchRecord, lines: list[PreparedLine]) -> None:
        """One job per line, in this order; a line queued before (its claim taken) is left."""
        k = self.keys
        claim_ttl_s = int(record.expires_at - time.time()) + CLAIM_MARGIN_S
        calls = []
        for p in lines:
            job = BatchJob(
                p.line, p.request.custom_id, p.plan.kind == "chatcmpl", p.plan.want_logprobs
            )
            body = p.body.model_copy(update={"metadata": job.metadata(record.id, p.plan.req.user)})
            spec = p.spec.model_copy(
                update={"id": batch_job_id(record.id, p.line), "deadline": record.expires_at}
            )
            submission = self.state.jobs.submission(
                body,
                spec,
                k.batch_line(record.id, p.line),
                idempotency_ttl_s=claim_ttl_s,
                done_stream=k.batch_done(record.id),
            )
            calls.append(submission.call)
            if len(calls) % CHECK_GROUP == 0:
                await asyncio.sleep(0)
        for start in range(0, len(calls), SUBMIT_PIPELINE):
            replies = await self.scripts.run_all(calls[start : start + SUBMIT_PIPELINE])
            refused = next((r for r in replies if isinstance(r, Exception)), None)
            if refused is not None:  # e.g. Redis out of memory: queue the chunk again later
                raise refused

    # ---- the end --------------------------------------------------------------------------

    async def _end(self, record: BatchRecord, lease: Lease) -> None:
        ending = record.ending or "completed"
        if record.resolved < record.total:
            await self._close_lines(record, lease, None if ending == "completed" else ending)
            fresh = await self._load(record.id)
            if fresh is None or fresh.resolved < fresh.total:
                return  # lines still open (a job not ended yet): the next turn goes on
            record = fresh
        await self.finalizer.run(record, lease)

    async def _close_lines(self, record: BatchRecord, lease: Lease, closing: str | None) -> None:
        """Resolve every open line whose job ended (a sweep). With `closing` (expired,
        cancelled), resolve the others too: their jobs are cancelled and they fail."""
        last = record.total if closing else record.lines_queued
        for start in range(1, last + 1, SWEEP_RANGE):
            await lease.renew()
            lines = range(start, min(start + SWEEP_RANGE, last + 1))
            open_lines = await self._open_lines(record.id, lines)
            if open_lines:
                await self._close_range(record, open_lines, closing)

    async def _open_lines(self, batch_id: str, lines: Sequence[int]) -> list[int]:
        fields = [str(n) for n in lines]
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(self.keys.batch_results(batch_id, "out"), fields)
        pipe.hmget(self.keys.batch_results(batch_id, "err"), fields)
        out, err = await pipe.execute()
        return [n for n, o, e in zip(lines, out, err, strict=True) if o is None and e is None]

    async def _close_range(
        self, record: BatchRecord, lines: list[int], closing: str | None
    ) -> None:
        queued = [n for n in lines if n <= record.lines_queued]
        jobs = [batch_job_id(record.id, n) for n in queued]
        pipe = self.redis.pipeline(transaction=False)
        for job_id in jobs:
            pipe.hgetall(self.keys.job(job_id))
        raws = await pipe.execute()
        gone: list[int] = [n for n in lines if n > record.lines_queued]
        records: dict[str, tuple[int, JobRecord]] = {}
        for n, job_id, raw in zip(queued, jobs, raws, strict=True):
            try:
                records[job_id] = (n, JobRecord.from_hash(raw))
            except RecordError as exc:  # an empty hash too: the job is gone
                if raw:
                    log.error("unreadable batch job", extra={"job_id": job_id, "error": str(exc)})
                gone.append(n)
        logs = await read_logs(self.redis, self.keys, {j: r for j, (_, r) in records.items()})
        results: list[LineResult] = []
        unended: list[tuple[int, str, str]] = []
        for job_id, (n, job) in records.items():
            try:
                result = result_of(
                    job_id, job, logs.get(job_id), batch_cancelling=closing == "cancelled"
                )
                if result is None:
                    unended.append((n, job_id, BatchJob.of(job).custom_id))
                else:
                    results.append(result)
            except (RecordError, EventError) as exc:
                log.error("unreadable batch job", extra={"job_id": job_id, "error": str(exc)})
                gone.append(n)
        if closing is not None:
            code, message = _closing(closing)
            results += [error_line(n, j, c, code, message) for n, j, c in unended]
        results += await self._lost_lines(record, sorted(gone), closing)
        if results:
            await self._write(record.id, results)
        if closing is not None:  # after their lines failed: a cancel's own end changes nothing
            await self.state.jobs.cancel_many([j for _, j, _ in unended], f"batch {closing}")

    async def _lost_lines(
        self, record: BatchRecord, lines: list[int], closing: str | None
    ) -> list[LineResult]:
        """Lines with no job: never queued (closing), or whose job is gone (lost in Redis)."""
        source = InputLines(self.store, record)
        out = []
        for n in lines:
            raw = await source.line(n)
            custom_id = "" if raw is None else custom_id_of(raw)
            if n > record.lines_queued and closing is not None:
                code, message = _closing(closing)
            else:
                code, message = "job_lost", "the line's job is gone from Redis"
            out.append(error_line(n, batch_job_id(record.id, n), custom_id, code, message))
        return out

    async def _write(self, batch_id: str, results: list[LineResult]) -> None:
        call = self.tx.results(batch_id, results, ttl_s=self.settings.batch_ttl_s)
        await self.scripts.run(call)


def _closing(closing: str) -> tuple[str, str]:
    if closing == "cancelled":
        return CANCELLED_CODE, CANCELLED_MESSAGE
    return EXPIRED_CODE, EXPIRED_MESSAGE


def _gone(batch_id: str, n: int) -> LineResult:
    return error_line(
        n,
        batch_job_id(batch_id, n),
        "",
        "file_not_found",
        "the batch's input file is gone (deleted or expired) before this line was queued",
    )


def _refused(batch_id: str, problem: LineProblem, custom_id: str) -> LineResult:
    return error_line(
        problem.line,
        batch_job_id(batch_id, problem.line),
        custom_id,
        problem.code,
        problem.describe(),
    )
