"""A batch's input, a chunk at a time, into its model's queue: each line checked again (as at
upload: its job is built now) and queued as one `batch`-priority job.

Idempotent: a line's job has an id that follows from the batch and the line
(`batch_job_id`), and is created by a SUBMIT that also claims the line's key
(`Keys.batch_line`), so a chunk queued twice (a driver that died before moving its cursor)
makes no job twice. A chunk goes in groups of `QUEUE_GROUP` lines, each queued as soon as it
is checked (its SUBMITs run in Redis while the next group is checked), so the workers start
on a chunk's first lines while the rest are still checked.
Within a group, lines are queued sorted by their prompt's tokens: lines sharing a prefix (a
system prompt) reach the engine together, and its prefix cache shares their pages.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from itertools import accumulate

from gateway.batch.lease import Lease
from gateway.batch.lines import LineChecker, LineProblem, PreparedLine, custom_id_of
from gateway.batch.results import BatchJob, error_line
from gateway.batch.storage import FileStore
from gateway.identity import Identity
from gateway.state import GatewayState
from shared.batch_transitions import LineResult
from shared.batches import BatchRecord, batch_job_id
from shared.records import ANONYMOUS
from shared.transitions import ScriptRunner

log = logging.getLogger(__name__)

CHECK_GROUP = 128
"""Lines checked (or jobs built) between two yields to the event loop."""
SUBMIT_PIPELINE = 100
"""SUBMITs per pipeline."""
QUEUE_GROUP = 256
"""Lines checked, then queued together (sorted by prompt), before the next are checked."""
CLAIM_MARGIN_S = 3600
"""A line's claim outlives the batch's deadline by this much (no chunk is queued later)."""


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


class Queuer:
    def __init__(self, state: GatewayState, store: FileStore) -> None:
        self.state = state
        self.keys = state.keys
        self.store = store
        self.scripts = ScriptRunner(state.redis)
        self.checker = LineChecker(state)

    async def queue(self, record: BatchRecord, lease: Lease) -> list[LineResult]:
        """Queue the lines of the batch's next chunk; the errors of those that cannot run
        (for the caller to write before it moves the cursor)."""
        index = record.queued_chunks
        first = sum(record.chunks[:index]) + 1
        raws = await InputLines(self.store, record).chunk(index)
        last = min(first + record.chunks[index], record.total + 1)  # trailing blanks: none
        prepared: list[PreparedLine] = []
        failed: list[LineResult] = []
        queued, model = 0, None
        # A group's SUBMITs run in Redis while the next group is checked here.
        submitting: asyncio.Task[int] | None = None
        try:
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
                    model = checked.spec.model
                if len(prepared) >= QUEUE_GROUP:
                    queued += await submitting if submitting is not None else 0
                    submitting = asyncio.create_task(self._submit(record, prepared))
                    prepared = []
                    await lease.renew()
                elif (n - first) % CHECK_GROUP == CHECK_GROUP - 1:
                    await asyncio.sleep(0)  # tokenizing is CPU work: let the loop serve others
            queued += await submitting if submitting is not None else 0
            submitting = None
            queued += await self._submit(record, prepared)
        finally:
            if submitting is not None:  # checking failed: the chunk is queued again later
                submitting.cancel()
                await asyncio.wait({submitting})  # its outcome is not ours to raise
        await lease.renew()
        if queued:  # one line per chunk: a batch's jobs are `batch_job_id(batch, line)`
            log.info(
                "batch lines queued",
                extra={"batch_id": record.id, "jobs": queued, "model": model},
            )
        return failed

    async def _submit(self, record: BatchRecord, lines: list[PreparedLine]) -> int:
        """One job per line, sorted by prompt; a line queued before (its claim taken) is left.
        How many lines it was given."""
        lines = sorted(lines, key=lambda p: p.spec.input_ids)
        k = self.keys
        claim_ttl_s = int(record.expires_at - time.time()) + CLAIM_MARGIN_S
        owner = Identity(
            record.owner or ANONYMOUS, keyed=bool(self.state.settings.accepted_api_keys)
        )
        calls = []
        for p in lines:
            chat = p.plan.kind == "chatcmpl"
            job = BatchJob(p.line, p.request.custom_id, chat, p.plan.want_logprobs)
            body = p.body.model_copy(update={"metadata": job.metadata(record.id, p.plan.req.user)})
            spec = p.spec.model_copy(
                update={"id": batch_job_id(record.id, p.line), "deadline": record.expires_at}
            )
            submission = self.state.jobs.submission(
                body,
                spec,
                k.batch_line(record.id, p.line),
                caller=owner,
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
        return len(lines)


def _gone(batch_id: str, n: int) -> LineResult:
    return error_line(
        n,
        batch_job_id(batch_id, n),
        "",
        "file_not_found",
        "the batch's input file is gone (deleted or expired) before this line was queued",
    )


def _refused(batch_id: str, problem: LineProblem, custom_id: str) -> LineResult:
    job_id = batch_job_id(batch_id, problem.line)
    return error_line(problem.line, job_id, custom_id, problem.code, problem.describe())
