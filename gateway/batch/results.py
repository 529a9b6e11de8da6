"""A batch job's end as the line of the output file (it succeeded: the response body the live
endpoint would have returned, built from the job's events exactly as the live endpoint builds
it) or of the error file (it failed, expired or was cancelled: `{code, message}`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway.openai.output import (
    ChatFormat,
    ChoiceState,
    CompletionFormat,
    OutputFormat,
    RequestState,
)
from shared import events
from shared.batch_transitions import BatchTransitions, LineResult, ResultsWritten
from shared.batches import (
    CANCELLED_CODE,
    CANCELLED_MESSAGE,
    EXPIRED_CODE,
    EXPIRED_MESSAGE,
    LineError,
    LineResponse,
    ResultLine,
)
from shared.deadlines import EXPIRED_CODE as JOB_DEADLINE_CODE
from shared.events import EVENT_FIELD
from shared.keys import Keys
from shared.records import JobRecord, RecordError
from shared.schemas import TERMINAL_STATUSES
from shared.settings import GatewaySettings
from shared.transitions import ScriptRunner

CHAT_API = "openai.chatcmpl"
"""`metadata.api` of a job made from a /v1/chat/completions line (else /v1/completions)."""
_OUTPUT_EVENTS = frozenset({"token", "done", "error", "cancelled"})
HTTP_OK = 200

Entries = Sequence[tuple[str, dict[str, str]]]
"""A stream's entries as the client gives them: (id, fields)."""


@dataclass(frozen=True, slots=True)
class BatchJob:
    """What a batch's job carries in its metadata (set when its line is queued)."""

    line: int
    custom_id: str
    chat: bool
    logprobs: bool

    def metadata(self, batch_id: str, user: str | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "api": CHAT_API if self.chat else "openai.cmpl",
            "batch": batch_id,
            "line": self.line,
            "custom_id": self.custom_id,
            "logprobs": self.logprobs,
        }
        if user is not None:
            meta["user"] = user
        return meta

    @classmethod
    def of(cls, record: JobRecord) -> BatchJob:
        m = record.metadata
        try:
            return cls(
                int(m["line"]), str(m["custom_id"]), m["api"] == CHAT_API, bool(m["logprobs"])
            )
        except (KeyError, TypeError, ValueError):
            raise RecordError("not a batch job: its metadata lacks line or custom_id") from None


def line_id(job_id: str) -> str:
    return f"batch_req_{job_id}"


def error_line(line: int, job_id: str, custom_id: str, code: str, message: str) -> LineResult:
    out = ResultLine(
        id=line_id(job_id), custom_id=custom_id, error=LineError(code=code, message=message)
    )
    return LineResult(line, "err", out.model_dump_json())


def needs_log(record: JobRecord) -> bool:
    """Whether the job's line is built from its event log: logprobs live only there (the
    record holds the text, finish reason and usage the live endpoint would answer with)."""
    return record.status == "succeeded" and bool(record.metadata.get("logprobs"))


def result_of(
    job_id: str,
    record: JobRecord,
    log: Entries | None,
    *,
    batch_cancelling: bool,
) -> LineResult | None:
    """The line a job's end makes (`log`: its event log, where `needs_log`); None while the
    job has not ended. RecordError or EventError for a record or log that does not decode."""
    if record.status not in TERMINAL_STATUSES:
        return None
    job = BatchJob.of(record)
    if record.status == "succeeded":
        return _output_line(job_id, job, record, log)
    if record.status == "cancelled":
        code, message = "cancelled", f"job {job_id} was cancelled"
        if batch_cancelling:
            code, message = CANCELLED_CODE, CANCELLED_MESSAGE
        return error_line(job.line, job_id, job.custom_id, code, message)
    error = record.error
    code = error.code if error else record.status
    message = error.message if error else f"the job ended {record.status}"
    if code == JOB_DEADLINE_CODE:  # its deadline is the batch's
        code, message = EXPIRED_CODE, EXPIRED_MESSAGE
    return error_line(job.line, job_id, job.custom_id, code, message)


def _output_line(
    job_id: str,
    job: BatchJob,
    record: JobRecord,
    log: Entries | None,
) -> LineResult:
    spec = record.spec
    fmt: OutputFormat = (
        ChatFormat.of(job.logprobs, spec.constraint) if job.chat else CompletionFormat(job.logprobs)
    )
    kind = "chatcmpl" if job.chat else "cmpl"
    choice = ChoiceState(0, job_id, 0)
    run = RequestState(f"{kind}-{job_id}", int(spec.created_at), spec.model, [choice], [])
    run.prompt_tokens.append(len(spec.input_ids))
    if log is not None:  # as the live endpoint does: every output event, in order
        for _, fields in log:
            data = fields[EVENT_FIELD]
            if events.peek(data)[1] in _OUTPUT_EVENTS:
                choice.apply(events.decode(data))
    elif record.result is not None:  # the same, summed up by the worker
        choice.text.append(record.result.text)
        choice.finish_reason = record.result.finish_reason
        choice.schema_check = record.result.schema_check
        choice.usage = record.usage
    if choice.finish_reason is None:  # a log cut short (Redis lost its tail): say so
        return error_line(
            job.line, job_id, job.custom_id, "job_lost", f"job {job_id} has no final event"
        )
    out = ResultLine(
        id=line_id(job_id),
        custom_id=job.custom_id,
        response=LineResponse(status_code=HTTP_OK, request_id=job_id, body={}),
    )
    usage = choice.usage
    return LineResult(
        job.line,
        "out",
        _with_body(out.model_dump_json(), fmt.response(run).model_dump_json()),
        input_tokens=run.prompt_tokens[0],
        output_tokens=usage.completion_tokens if usage else 0,
        cached_tokens=usage.cached_tokens if usage else 0,
    )


def _with_body(line: str, body: str) -> str:
    """`line` (a ResultLine's JSON, its response's body `{}`) with `body` (the response's JSON)
    in its place: the response serialized once, not made a dict and serialized again. The
    last `"body":{}` is the body's: nothing but the response's end and `error` follows it, and
    inside a string (an id) its quotes would be escaped."""
    head, sep, tail = line.rpartition(_EMPTY_BODY)
    assert sep, line
    return f"{head}{_BODY}{body}{tail}"


_EMPTY_BODY = '"body":{}'
_BODY = '"body":'


async def read_logs(
    redis: aioredis.Redis, keys: Keys, records: dict[str, JobRecord]
) -> dict[str, Entries]:
    """The event logs of the jobs whose line is built from it (`needs_log`), in one pipeline."""
    wanted = [j for j, r in records.items() if needs_log(r)]
    if not wanted:
        return {}
    pipe = redis.pipeline(transaction=False)
    for job_id in wanted:
        pipe.xrange(keys.events(job_id))
    return dict(zip(wanted, await pipe.execute(), strict=True))


async def write_results(
    scripts: ScriptRunner,
    tx: BatchTransitions,
    batch_id: str,
    results: Sequence[LineResult],
    settings: GatewaySettings,
) -> ResultsWritten:
    """Each line's result, unless it has one (batch_results.lua)."""
    return await scripts.run(tx.results(batch_id, results, ttl_s=settings.batch_ttl_s))
