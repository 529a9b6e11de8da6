"""A batch's open lines, closed: a line has no result yet while its job runs, or when the
tracker missed its job's end (a sweep finds those), or when the batch ends early.

`close(record, lease, None)` is the sweep: every open line whose job ended gets its result.
With `closing` ("expired", "cancelled"), the other open lines fail too (`batch_expired`,
`batch_cancelled`), and only then are their jobs cancelled (queued ones end at once, running
ones are told to stop): the cancel's own end, read by the tracker, finds its line failed
already. A line whose job is gone from Redis fails `job_lost`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gateway.batch.lease import Lease
from gateway.batch.lines import custom_id_of
from gateway.batch.queueing import InputLines
from gateway.batch.results import BatchJob, error_line, read_logs, result_of, write_results
from gateway.batch.storage import FileStore
from gateway.state import GatewayState
from shared.batch_transitions import BatchTransitions, LineResult
from shared.batches import (
    CANCELLED_CODE,
    CANCELLED_MESSAGE,
    EXPIRED_CODE,
    EXPIRED_MESSAGE,
    BatchRecord,
    batch_job_id,
)
from shared.events import EventError
from shared.records import JobRecord, RecordError
from shared.transitions import ScriptRunner

log = logging.getLogger(__name__)

SWEEP_RANGE = 1000
"""Lines looked at per round."""


class Closer:
    def __init__(self, state: GatewayState, store: FileStore) -> None:
        self.state = state
        self.redis = state.redis
        self.keys = state.keys
        self.settings = state.settings
        self.store = store
        self.scripts = ScriptRunner(state.redis)
        self.tx = BatchTransitions(state.keys)

    async def close(self, record: BatchRecord, lease: Lease, closing: str | None) -> None:
        """Resolve every open line whose job ended; with `closing`, every other one too."""
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
        records, gone = await self._records(record, lines)
        logs = await read_logs(self.redis, self.keys, {j: r for j, (_, r) in records.items()})
        results: list[LineResult] = []
        unended: list[tuple[int, str, str]] = []
        for job_id, (n, job) in records.items():
            try:
                result = result_of(
                    job_id, job, logs.get(job_id), batch_cancelling=closing == "cancelled"
                )
            except (RecordError, EventError) as exc:
                log.error("unreadable batch job", extra={"job_id": job_id, "error": str(exc)})
                gone.append(n)
                continue
            if result is None:
                unended.append((n, job_id, BatchJob.of(job).custom_id))
            else:
                results.append(result)
        if closing is not None:
            code, message = _closing(closing)
            results += [error_line(n, j, c, code, message) for n, j, c in unended]
        results += await self._lost_lines(record, sorted(gone), closing)
        if results:
            await write_results(self.scripts, self.tx, record.id, results, self.settings)
        if closing is not None:  # after their lines failed: a cancel's own end changes nothing
            await self.state.jobs.cancel_many([j for _, j, _ in unended], f"batch {closing}")

    async def _records(
        self, record: BatchRecord, lines: list[int]
    ) -> tuple[dict[str, tuple[int, JobRecord]], list[int]]:
        """The job records of the queued lines (by job id, with the line), and the lines
        that have none: never queued, or whose job is gone."""
        queued = [n for n in lines if n <= record.lines_queued]
        jobs = [batch_job_id(record.id, n) for n in queued]
        pipe = self.redis.pipeline(transaction=False)
        for job_id in jobs:
            pipe.hgetall(self.keys.job(job_id))
        gone = [n for n in lines if n > record.lines_queued]
        records: dict[str, tuple[int, JobRecord]] = {}
        for n, job_id, raw in zip(queued, jobs, await pipe.execute(), strict=True):
            try:
                records[job_id] = (n, JobRecord.from_hash(raw))
            except RecordError as exc:  # an empty hash too: the job is gone
                if raw:
                    log.error("unreadable batch job", extra={"job_id": job_id, "error": str(exc)})
                gone.append(n)
        return records, gone

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


def _closing(closing: str) -> tuple[str, str]:
    if closing == "cancelled":
        return CANCELLED_CODE, CANCELLED_MESSAGE
    return EXPIRED_CODE, EXPIRED_MESSAGE
