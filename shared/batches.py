"""Files and batches (the OpenAI Files and Batches API): the records genq keeps in Redis, the
objects the API answers with, and the lines of batch input, output and error files.

A batch's input file is stored in chunks of whole lines (`FileRecord.chunks` counts the lines
of each), so the batch is queued a chunk at a time from a cursor (`BatchRecord.queued_chunks`)
that any gateway can carry on. Line `n` (1-based, as an editor counts) becomes job
`batch_job_id(batch, n)`, once: its idempotency claim (`Keys.batch_line`) is taken by the same
SUBMIT that writes the job. Each line's result is written once (shared/lua/batch_results.lua),
then all of them into the batch's output and error files, whose ids follow from the batch's
(`result_file_id`), so a finalizer that dies is simply run again.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.records import HashModel

FILE_ID = re.compile(r"file-[0-9a-f]{32}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")

FilePurpose = Literal["batch", "batch_output"]
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]
ENDPOINTS: tuple[BatchEndpoint, ...] = ("/v1/chat/completions", "/v1/completions")
BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
ENDED_BATCH_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
ResultKind = Literal["out", "err"]

MAX_CUSTOM_ID_CHARS = 512
MAX_WINDOW_S = 86_400
"""OpenAI's only window, 24h; shorter ones are a genq extension."""
_WINDOW = re.compile(r"([1-9][0-9]*)([smh])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}

EXPIRED_CODE = "batch_expired"
EXPIRED_MESSAGE = "the request was not completed within the batch's completion window"
CANCELLED_CODE = "batch_cancelled"
CANCELLED_MESSAGE = "the batch was cancelled before the request completed"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def batch_job_id(batch_id: str, line: int) -> str:
    """The job of line `line` of a batch: known without a lookup (cancel, sweeps)."""
    return hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:32]


def result_file_id(batch_id: str, kind: ResultKind) -> str:
    """The id of a batch's output (`out`) or error (`err`) file: the same on every attempt."""
    return f"file-{hashlib.sha256(f'{batch_id}:{kind}'.encode()).hexdigest()[:32]}"


WINDOW_PATTERN = (
    r"^(?:(?:[1-9]|1[0-9]|2[0-4])h|(?:[1-9][0-9]{0,2}|1[0-3][0-9]{2}|14[0-3][0-9]|1440)m"
    r"|(?:[1-9][0-9]{0,3}|[1-7][0-9]{4}|8[0-5][0-9]{3}|86[0-3][0-9]{2}|86400)s)$"
)
"""A completion window as the API document says it: a whole number of h, m or s, at most 24 h."""


def window_seconds(window: str) -> int:
    """Seconds of a completion window: `24h`, or shorter (`90m`, `30s`); ValueError if not."""
    m = _WINDOW.fullmatch(window)
    if m is None:
        raise ValueError("completion_window must be a whole number of s, m or h, e.g. 24h")
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds > MAX_WINDOW_S:
        raise ValueError("completion_window is at most 24h")
    return seconds


# ---- files --------------------------------------------------------------------------------


class FileObject(BaseModel):
    """OpenAI's File object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class FileRecord(HashModel):
    """Hash `file:{id}`: a stored file. Its content is in `filedata:{id}` (a list of chunks)."""

    id: str
    filename: str
    purpose: FilePurpose
    bytes: int
    created_at: float
    expires_at: float
    lines: int = 0
    """Request lines (batch input); trailing blank lines are not counted."""
    chunks: list[int] = Field(default_factory=list)
    """Lines in each stored chunk, in order."""
    endpoints: list[str] = Field(default_factory=list)
    """The urls its lines ask for (batch input)."""
    models: list[str] = Field(default_factory=list)
    """The models its lines ask for (batch input)."""
    owner: str | None
    """Who uploaded it, or whose batch wrote it (`owner_of` their API key, or ANONYMOUS);
    other keys get 404 for it. Required: every writer names it. None only on records written
    before owners were (`shared.records.OWNERS_SINCE`)."""

    def view(self) -> FileObject:
        return FileObject(
            id=self.id,
            bytes=self.bytes,
            created_at=int(self.created_at),
            expires_at=int(self.expires_at),
            filename=self.filename,
            purpose=self.purpose,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# ---- batches ------------------------------------------------------------------------------


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class BatchObject(BaseModel):
    """OpenAI's Batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: BatchUsage


def _at(t: float | None) -> int | None:
    return None if t is None else int(t)


class BatchRecord(HashModel):
    """Hash `batch:{id}`. Counters (`completed`, `failed`, tokens) move only in
    batch_results.lua, with the line's result; the status only in batch_update.lua."""

    id: str
    endpoint: BatchEndpoint
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: float
    expires_at: float
    """The deadline: the window from creation."""
    total: int
    chunks: list[int]
    """Lines per chunk of the input file (copied: a deleted input fails only what is left)."""
    queued_chunks: int = 0
    """Chunks queued so far: the cursor any gateway resumes from."""
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    ending: Literal["completed", "expired", "cancelled"] | None = None
    """Set when the batch starts to end: the status its finalizer gives it."""
    told: bool | None = None
    """Cluster: the webhook outbox heard of its final status (a step after it; the driver,
    cleaning up an ended batch, tells again where this is not set)."""
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[BatchError] | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    output_ttl_s: int
    owner: str | None
    """Who created it (`owner_of` their API key, or ANONYMOUS): its jobs, files and record are
    theirs. Required: every writer names it. None only on records written before owners were
    (`shared.records.OWNERS_SINCE`)."""

    @property
    def resolved(self) -> int:
        return self.completed + self.failed

    @property
    def lines_queued(self) -> int:
        """Lines 1..this are queued (or failed before they could be); the blank lines that
        may end the file's last chunk are no requests."""
        return min(sum(self.chunks[: self.queued_chunks]), self.total)

    def view(self) -> BatchObject:
        return BatchObject(
            id=self.id,
            endpoint=self.endpoint,
            errors=BatchErrors(data=self.errors) if self.errors else None,
            input_file_id=self.input_file_id,
            completion_window=self.completion_window,
            status=self.status,
            output_file_id=self.output_file_id,
            error_file_id=self.error_file_id,
            created_at=int(self.created_at),
            in_progress_at=_at(self.in_progress_at),
            expires_at=_at(self.expires_at),
            finalizing_at=_at(self.finalizing_at),
            completed_at=_at(self.completed_at),
            failed_at=_at(self.failed_at),
            expired_at=_at(self.expired_at),
            cancelling_at=_at(self.cancelling_at),
            cancelled_at=_at(self.cancelled_at),
            request_counts=RequestCounts(
                total=self.total, completed=self.completed, failed=self.failed
            ),
            metadata=self.metadata,
            model=self.model,
            usage=BatchUsage(
                input_tokens=self.input_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
                output_tokens=self.output_tokens,
                total_tokens=self.input_tokens + self.output_tokens,
            ),
        )


class ObjectList(BaseModel):
    """OpenAI's list page: `after` = the last id of this page fetches the next."""

    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# ---- lines of batch files -----------------------------------------------------------------


class RequestLine(BaseModel):
    """A line of a batch input file."""

    model_config = ConfigDict(extra="ignore")

    custom_id: str = Field(min_length=1, max_length=MAX_CUSTOM_ID_CHARS)
    method: Literal["POST"]
    url: BatchEndpoint
    body: dict[str, Any]


class LineResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(BaseModel):
    code: str
    message: str


class ResultLine(BaseModel):
    """A line of a batch's output file (`response`) or error file (`error`)."""

    id: str
    custom_id: str
    response: LineResponse | None = None
    error: LineError | None = None
