"""Every value genq keeps in Redis besides events: one model each, and the one codec that
writes and reads it (job record, queue entry, heartbeat, control message, dead letter).

Hashes and stream entries are flat: one Redis field per model field, `None` fields absent.
A string or number is stored as its plain text (so the Lua scripts can compare and count
it: `status`, `worker`, `attempt`); anything structured (a spec, a result) as its JSON.
`to_hash` / `from_hash` are the only ways in and out; `fields` encodes a partial update (the
fields a state transition sets), validated against the model like a whole record. A JSON
field may also be stored packed (`pack`: compressed, then base85, after a `~` no JSON text
starts with): what an ended job's compaction does to its result and spec; `from_hash` reads
both.
"""

from __future__ import annotations

import base64
import bz2
import hashlib
import json
import re
import types
import typing
import zlib
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Literal, Self

import msgspec
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shared.schemas import (
    ErrorInfo,
    JobResult,
    JobSpec,
    JobStatus,
    JobView,
    Timings,
    Usage,
    WebhookTarget,
)

JOB_ID = re.compile(r"[0-9a-f]{32}")
"""A job id: 32 lowercase hex digits (uuid4().hex); matched against the whole string."""
ANONYMOUS = "anonymous"
"""The owner of every job while the API is open (no API keys configured)."""
OWNERS_SINCE = 1_796_119_567.0
"""2026-12-01T10:06:07Z, when genq began recording owners. A record a key can reach (job,
file, batch) names its owner from its creation; one without an owner created before this
predates owners and stays visible to every key, as it was, until its retention ends. One
without an owner created since is a writer's mistake and is visible to admin keys only, so
the old rule ends with the old records and can never open a new one to every key."""
_OWNER_HEX_DIGITS = 32
"""128 bits of the key's SHA-256: no two keys collide, and the key cannot be recovered."""
_SCALARS = (str, int, float, bool)
PACKED = "~"
"""The first character of a packed value (`pack`): JSON text never starts with it. The next
names its codec."""
_CODECS: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
    "z": (lambda b: zlib.compress(b, zlib.Z_BEST_COMPRESSION), zlib.decompress),
    "b": (lambda b: bz2.compress(b, 9), bz2.decompress),
}


_JSON = msgspec.json.Decoder()


def _json_value(text: str) -> Any:
    """A JSON field's value: by msgspec (a third of `json.loads`'s time), else by `json.loads`,
    which also reads what `json.dumps` may have written and msgspec refuses (NaN, Infinity,
    1e400)."""
    try:
        return _JSON.decode(text)
    except msgspec.DecodeError:
        return json.loads(text)


class RecordError(ValueError):
    """A Redis value that does not decode into its model."""


def _is_scalar(annotation: Any) -> bool:
    """Whether values of this type are stored as plain text (else as JSON)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return True
    if origin in (typing.Union, types.UnionType):
        return all(_is_scalar(a) for a in typing.get_args(annotation) if a is not type(None))
    return annotation in _SCALARS


def _admits_none(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return type(None) in typing.get_args(annotation)
    return annotation is None or annotation is type(None)


def _text(value: bytes | str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise RecordError("a field is not UTF-8 text") from None
    return value


def pack(text: str) -> str:
    """`text` compressed and made printable (Redis values are read as UTF-8 text): by zlib or
    bz2, whichever is smaller (bz2 wins on a few KB of text and token ids), then base85."""
    data = text.encode()
    codec, packed = min(
        ((c, compress(data)) for c, (compress, _) in _CODECS.items()), key=lambda x: len(x[1])
    )
    return PACKED + codec + base64.b85encode(packed).decode()


def unpack(value: str) -> str:
    """What `pack` packed; any other value as it is. RecordError for a damaged packed value."""
    if not value.startswith(PACKED):
        return value
    codec = _CODECS.get(value[1:2])
    try:
        if codec is None:
            raise ValueError("no such codec")
        return codec[1](base64.b85decode(value[2:])).decode()
    except (ValueError, OSError, zlib.error, UnicodeDecodeError):
        raise RecordError("a packed field does not unpack") from None


class HashModel(BaseModel):
    """A model stored as a flat Redis hash (or stream entry)."""

    @classmethod
    @cache
    def _names(cls) -> tuple[str, ...]:
        """The model's fields, looked up once: `cls.model_fields` is a descriptor that costs
        microseconds a read (pydantic 2.11+), several times a job on the hot paths."""
        return tuple(cls.model_fields)

    @classmethod
    @cache
    def _json_fields(cls) -> frozenset[str]:
        return frozenset(n for n, f in cls.model_fields.items() if not _is_scalar(f.annotation))

    @classmethod
    @cache
    def _adapter(cls, name: str) -> TypeAdapter[Any]:
        annotation = cls.model_fields[name].annotation
        assert annotation is not None  # every field of these models is annotated
        return TypeAdapter(annotation)

    @classmethod
    @cache
    def _required_nullable(cls) -> frozenset[str]:
        """Fields a writer must name (no default) that may hold None: `to_hash` leaves a None
        out, so such a field absent from a hash was written None."""
        return frozenset(
            n for n, f in cls.model_fields.items() if f.is_required() and _admits_none(f.annotation)
        )

    @classmethod
    def _encode(cls, name: str, value: Any) -> str:
        if name in cls._json_fields():
            if isinstance(value, BaseModel):
                return value.model_dump_json()
            return json.dumps(cls._adapter(name).dump_python(value, mode="json"))
        if isinstance(value, bool):
            return "1" if value else "0"
        return value if isinstance(value, str) else repr(value)

    def to_hash(self) -> dict[str, str]:
        return {
            name: self._encode(name, value)
            for name in type(self)._names()
            if (value := getattr(self, name)) is not None
        }

    @classmethod
    def fields(cls, **values: Any) -> dict[str, str]:
        """A partial update: each value validated as its field, then encoded (a model built
        already, of the field's own class, was validated when it was built)."""
        out: dict[str, str] = {}
        names = cls._names()
        for name, value in values.items():
            if name not in names:
                raise KeyError(f"{cls.__name__} has no field {name!r}")
            if type(value) is not cls._model_of(name):
                value = cls._adapter(name).validate_python(value)
            out[name] = cls._encode(name, value)
        return out

    @classmethod
    @cache
    def _model_of(cls, name: str) -> type[BaseModel] | None:
        """The model class a field holds (`X` or `X | None`), if it holds one."""
        annotation = cls.model_fields[name].annotation
        args = typing.get_args(annotation) if _admits_none(annotation) else (annotation,)
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 and len(args) <= 2 else None

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> Self:
        """The model the hash holds; RecordError (naming the reason) when it holds none."""
        data: dict[str, Any] = {}
        json_fields = cls._json_fields()
        try:
            for key, value in raw.items():
                name, text = _text(key), _text(value)
                data[name] = _json_value(unpack(text)) if name in json_fields else text
            for name in cls._required_nullable() - data.keys():
                data[name] = None
            return cls.model_validate(data)
        except json.JSONDecodeError as exc:
            raise RecordError(f"a field is not JSON: {exc.msg}") from None
        except ValidationError as exc:
            e = exc.errors()[0]
            where = ".".join(str(x) for x in e.get("loc", ())) or "record"
            raise RecordError(f"{where}: {e.get('msg')}") from None


# ---- the job record -----------------------------------------------------------------------


def owner_of(api_key: bytes) -> str:
    """The owner a job records for the API key that submitted it: a hash, never the key."""
    return hashlib.sha256(api_key).hexdigest()[:_OWNER_HEX_DIGITS]


class JobRecord(HashModel):
    """Hash `job:{id}`. Written at submission (whole), then by the state transitions
    (shared/lua: `status`, `worker`, `attempt`, `handbacks`, `interruptions`, `started_at`,
    `cancel`, `last_error`; the rest as `fields` the worker or gateway encodes)."""

    spec: JobSpec
    status: JobStatus
    attempt: int = 0
    """Attempts started (START counts them)."""
    handbacks: int = 0
    """Attempts given back by a draining worker: not failures, not counted against the job."""
    interruptions: int = 0
    """Attempts a stop of their worker ended (handed back at a drain): bounded by
    `max_interruptions`."""
    worker: str | None = None
    """The worker running it (while `running`): with `attempt` and `status`, ownership."""
    started_at: float | None = None
    finished_at: float | None = None
    result: JobResult | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    last_error: str | None = None
    """The engine error of the last failed attempt (shown if the job runs out of attempts)."""
    cancel: str | None = None
    """A cancel asked for while it ran (the reason); the worker reads it."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    fingerprint: str | None = None
    """Hash of the submitted body, to tell an idempotent replay from a reused key."""
    owner: str | None
    """Who submitted it (`owner_of` its API key, or ANONYMOUS). Required: every writer names
    it. None only on records written before owners were (see OWNERS_SINCE)."""
    webhook: WebhookTarget | None = None
    """Where its end is told (its submitter's `webhook`)."""
    notify: str | None = None
    """The webhook outbox stream told the job's id in the step that ends it (as `done_stream`):
    set when the job has a webhook or a deployment endpoint wants its kind of event."""
    done_stream: str | None = None
    """A stream told the job's id in the step that ends it (EMIT of a final event, SETTLE):
    a batch's, so that its tracker learns which lines finished without polling them."""
    told: bool | None = None
    """Cluster: the outbox of `notify` heard of the end (a step after it; a START that finds
    the job ended without it tells again)."""
    log: str | None = None
    """The compact form of its event log (`shared.compact`, packed), once the log was
    compacted (GENQ_EVENT_COMPACT_GRACE_S after the job ended); the log is gone then."""

    @property
    def created_at(self) -> float:
        return self.spec.created_at

    def view(self) -> JobView:
        result = self.result
        return JobView(
            id=self.spec.id,
            status=self.status,
            model=self.spec.model,
            priority=self.spec.priority,
            attempt=self.attempt,
            worker=self.worker,
            created_at=self.spec.created_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            text=result.text if result else None,
            finish_reason=result.finish_reason if result else None,
            usage=self.usage,
            timings=self.timings,
            error=self.error,
            cancel_requested=self.status == "running" and self.cancel is not None,
            metadata=self.metadata,
            constraint=self.spec.constraint.shown() if self.spec.constraint else None,
            schema_check=result.schema_check if result else None,
        )


CANCEL_FIELD = "cancel"
"""`JobRecord.cancel`, read on its own by a worker whose control channel was away."""


# ---- queues -------------------------------------------------------------------------------


class QueueEntry(HashModel):
    """An entry of a model's queue stream: a job waiting for a worker."""

    job: str = Field(pattern=f"^{JOB_ID.pattern}$")  # pydantic's regex: $ is the very end
    tokens: int = Field(default=0, ge=0)
    """Prompt + max new tokens: what the job needs of the engine's cache."""
    owner: str | None = None
    """The job's owner (as in its record), for claiming fairly between owners; None on
    entries written before owners were recorded."""
    wait_ms: int | None = None
    """In a worker's own lane (placement): how long the job may wait there for that worker,
    from when it was queued; then any worker may take it (the steal sweep). None elsewhere."""


class RecentJob(HashModel):
    """An entry of the recent-jobs stream (`Keys.recent_jobs`): a job submitted (with its
    model and priority) or ended (with its final status), written by the script that does
    it. Ids and what the dashboard shows only: never the prompt, never the owner."""

    job: str
    status: str
    model: str | None = None
    priority: str | None = None


class DeadLetter(HashModel):
    """An entry of the dead-letter stream: a job (or a queue entry) given up on."""

    job: str | None = None
    """None when the entry named no job genq could read."""
    queue: str
    entry: str
    """The queue entry's id."""
    attempts: int = 0
    reason: str
    at: float


# ---- workers ------------------------------------------------------------------------------


class Heartbeat(HashModel):
    """Hash `worker:<id>` with TTL = the worker's lease."""

    worker_id: str
    model: str
    engine: str
    gpu: str | None = None
    host: str
    pid: int
    version: str
    capacity: int
    active: int
    tokens_per_s: float
    started_at: float
    draining: bool = False
    engine_pid: int | None = None
    """The worker's engine process; None while it restarts, or with the engine in-process."""
    engine_down: str | None = None
    """Why the engine cannot take jobs now (its process died or stalled and restarts)."""
    engine_restarts: int = 0
    cache_version: int = 0
    """Changes whenever the worker's cache summary (`Keys.cache_summary`) does."""
    cache_pages: int = 0
    """Pages its cache model holds (worker/cachemodel.py)."""
    engine_step_ms: float = 0.0
    """Mean time of the engine's own step since the last beat, in the engine process."""
    worker_step_ms: float = 0.0
    """Mean time from one step's outputs to the next's as the worker received them, since the
    last beat: less `engine_step_ms`, what the engine boundary costs a step."""
    steps: int = 0
    engine_step_s: float = 0.0
    worker_steps: int = 0
    worker_step_s: float = 0.0
    """Cumulative (tools take deltas): steps and their engine seconds; steps timed as the
    worker saw them (those that followed another without a pause) and their seconds."""
    beat_at: float = 0.0
    """When the worker wrote this beat (its clock, unix seconds); 0 on older workers'."""
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    """The engine's cache pages in use (or promised to jobs starting) and in all, as the
    worker's admission counts them; both 0 for an engine that counts no pages (sim)."""
    waiting: int = 0
    """Jobs claimed from the queue and not started yet (waiting for room in the engine)."""
    free: int = 0
    """Jobs it could start now: batch slots free, none while a claim waits for room."""
    job_s: float = 0.0
    """How long a job holds its slot here (start to end), recently; 0: none ended yet."""
    prefill_tps: float = 0.0
    """Prompt tokens its engine prefills a second, as measured here; 0: not measured yet."""
    prefill_backlog: int = 0
    """Prompt tokens of the jobs started here still to prefill (no first token yet)."""
    prefill_serial: bool = False
    """Its engine prefills one job after another: a new job waits for the backlog first."""


class WorkerLoad(typing.TypedDict):
    """What a worker says of its load, in its heartbeat and in its cache news alike (the
    fields of both, described in `Heartbeat`)."""

    active: int
    waiting: int
    free: int
    job_s: float
    prefill_tps: float
    prefill_backlog: int
    prefill_serial: bool


LOAD_FIELDS: tuple[str, ...] = tuple(WorkerLoad.__annotations__)


class CacheNews(BaseModel):
    """A message on `Keys.cache_news`: what changed in a worker's prefix cache, and its load.

    A worker sends one with each flush (and beat) in which jobs started or ended there: the
    page hashes its cache model took in (prompts at their start, prompt and reply at their
    end) and dropped (evicted), between its cache versions `since` and `version`, and its
    load as its heartbeat says it. A gateway process sends one with the submit of each job
    it placed (`gateway`: which process; `placed`: jobs): that job's prompt pages will be
    there. Page hashes are packed as in the cache summary (`shared.pages.pack_summary`)."""

    model_config = ConfigDict(extra="ignore")

    worker: str
    seq: int = 0
    """The worker's count of its news (0 for a gateway's): newer news replaces the load."""
    since: int = 0
    version: int = 0
    added: str = ""
    dropped: str = ""
    gateway: str = ""
    placed: int = 0
    active: int = 0
    waiting: int = 0
    free: int = 0
    job_s: float = 0.0
    prefill_tps: float = 0.0
    prefill_backlog: int = 0
    prefill_serial: bool = False
    lane: int = 0
    """Jobs waiting in the worker's own lanes, not read by it yet: counted by the script
    that publishes the worker's news (`Transitions.cache_news`), never by its sender."""

    def encode(self) -> str:
        return self.model_dump_json(exclude_defaults=True)

    @classmethod
    def decode(cls, data: str | bytes) -> CacheNews:
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise RecordError(f"not cache news: {exc.errors()[0].get('msg')}") from None


class StoppedWorker(BaseModel):
    """A field of the hash `workers:stopped` (JSON), keyed by worker id: a worker process its
    launcher stopped for dying again and again (a crash loop), while the others go on. The
    launcher writes it again every `STOPPED_REPORT_S` with a later `until`; a launcher gone,
    its entries lapse."""

    worker_id: str
    model: str
    gpu: str | None = None
    host: str
    reason: str
    exit_codes: list[int]
    since: float
    """When it was stopped (unix seconds)."""
    until: float
    """Shown until then, unless written again (unix seconds)."""

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, data: str | bytes) -> StoppedWorker:
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise RecordError(f"not a stopped worker: {exc.errors()[0].get('msg')}") from None


class ControlMessage(BaseModel):
    """A command on a worker's control channel (JSON)."""

    model_config = ConfigDict(extra="forbid")

    cancel: str
    """The job to stop."""
    attempt: int | None = None
    """The attempt to stop; None: whichever this worker runs."""
    reason: str = "cancelled"
    expire: bool = False
    """Stop it as past its deadline (it ends `expired`), not as cancelled."""

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, data: str | bytes) -> ControlMessage:
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise RecordError(f"not a control message: {exc.errors()[0].get('msg')}") from None


class IdempotencyClaim(BaseModel):
    """What an idempotency key holds: the job it made, and the body that made it."""

    job: str
    fingerprint: str

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, data: str | bytes) -> IdempotencyClaim:
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise RecordError(f"not an idempotency claim: {exc.errors()[0].get('msg')}") from None
