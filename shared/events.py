"""A job's events: the models, and the one codec every writer and reader uses.

Every event carries the envelope `seq` (1, 2, 3, … per job, never reused) and `attempt`, then
its `type` and fields. The JSON is produced here (`encode`) by whoever owns the job's state
(the gateway, the worker) and stored as is: in the job's event log (stream entry `0-<seq>`,
field `d`) and on its pub/sub channel. The Lua scripts never build an event; they only compare
`seq`s they are handed with the log's last entry id.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
)

from shared.constraints import SchemaCheck
from shared.keys import Priority
from shared.schemas import FinishReason, Timings, Usage

EVENT_FIELD = "d"
"""The field of an event-log stream entry that holds the event's JSON."""
SERVER_STOPPING = "server_stopping"
"""The code of the `error` a gateway ends a stream with when it stops before the job ends
(never in the job's log: the job itself goes on, or is cancelled, as `resumes` says)."""


class _Event(BaseModel):
    seq: int
    attempt: int = 0


class QueuedEvent(_Event):
    type: Literal["queued"] = "queued"
    id: str
    model: str
    priority: Priority
    prompt_tokens: int


class StartedEvent(_Event):
    type: Literal["started"] = "started"
    worker: str
    resumed_tokens: int = 0


class TokenEvent(_Event):
    type: Literal["token"] = "token"
    text: str
    token_ids: list[int]
    count: int
    logprobs: list[dict[str, Any]] | None = None


class DoneEvent(_Event):
    type: Literal["done"] = "done"
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    schema_check: SchemaCheck | None = None
    """A job under a JSON schema: whether its output is valid under the whole schema."""


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str
    message: str
    resumes: bool | None = None
    """Only in a `server_stopping` end: whether the job goes on (to be followed again with
    Last-Event-ID) or was cancelled with its stream. Left out of the JSON when None."""

    @model_serializer(mode="wrap")
    def _without_unset_resumes(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if self.resumes is None:
            out.pop("resumes", None)
        return out


class CancelledEvent(_Event):
    type: Literal["cancelled"] = "cancelled"
    reason: str = "cancelled"


Event = QueuedEvent | StartedEvent | TokenEvent | DoneEvent | ErrorEvent | CancelledEvent
StreamEvent = Annotated[Event, Field(discriminator="type")]
FINAL_EVENT_TYPES: frozenset[str] = frozenset({"done", "error", "cancelled"})
_ADAPTER: TypeAdapter[StreamEvent] = TypeAdapter(StreamEvent)


class EventError(ValueError):
    """Bytes that are not an event of this contract."""


def encode(event: Event) -> str:
    return event.model_dump_json()


def decode(data: str | bytes) -> Event:
    """The event `data` holds; EventError when it is not one."""
    try:
        return _ADAPTER.validate_json(data)
    except ValidationError as exc:
        raise EventError(f"not a genq event: {exc.errors()[0].get('msg')}") from None


def envelope(data: str | bytes) -> tuple[int, str, int]:
    """(seq, type, attempt) of an encoded event, without building its model."""
    try:
        obj = json.loads(data)
        return int(obj["seq"]), str(obj["type"]), int(obj.get("attempt", 0))
    except (ValueError, KeyError, TypeError) as exc:
        raise EventError(f"not a genq event: {exc}") from None


def peek(data: str | bytes) -> tuple[int, str]:
    """(seq, type) of an encoded event without building its model: the gateway's hot path
    routes every event by these two and passes the JSON through untouched."""
    try:
        obj = json.loads(data)
        return int(obj["seq"]), str(obj["type"])
    except (ValueError, KeyError, TypeError) as exc:
        raise EventError(f"not a genq event: {exc}") from None
