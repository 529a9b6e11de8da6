"""Batches behind the routes: create, look up, list, cancel. The work (queueing, results,
the end) is the driver's and the tracker's; this module only writes a new batch and asks for
a cancel."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError
from redis.exceptions import ResponseError

from gateway.batch.files import MAX_EXPIRES_AFTER_S, MIN_EXPIRES_AFTER_S, FileService
from gateway.batch.listing import page
from gateway.identity import Identity
from gateway.state import GatewayState
from gateway.webhooks import batch_notify
from shared.batch_transitions import BatchTransitions
from shared.batches import (
    BATCH_ID,
    ENDPOINTS,
    WINDOW_PATTERN,
    BatchEndpoint,
    BatchObject,
    BatchRecord,
    ObjectList,
    new_batch_id,
    window_seconds,
)
from shared.errors import BadRequest, Conflict, NotFound, shown
from shared.keys import Keys
from shared.transitions import ScriptRunner

log = logging.getLogger(__name__)

TRACKERS = "gateways"
"""The consumer group of gateways reading a batch's done stream."""
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
"""OpenAI's bounds on a batch's metadata."""
CANCELLABLE = ("validating", "in_progress")


class OutputExpiresAfter(BaseModel):
    anchor: str = Field(pattern="^created_at$")
    seconds: int = Field(ge=MIN_EXPIRES_AFTER_S, le=MAX_EXPIRES_AFTER_S)


class CreateBatch(BaseModel):
    """Body of `POST /v1/batches`."""

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: BatchEndpoint
    completion_window: str = Field(
        default="24h",
        json_schema_extra={"pattern": WINDOW_PATTERN},
        description="24h, or shorter (a genq extension): 90m, 30s, …",
    )
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiresAfter | None = None

    @field_validator("completion_window")
    @classmethod
    def _window(cls, window: str) -> str:
        # checked here rather than by `pattern`, whose refusal would quote the regex
        try:
            window_seconds(window)
        except ValueError:
            raise PydanticCustomError(
                "completion_window",
                "must be a whole number of hours, minutes or seconds, at most 24h "
                "(24h, 90m, 30s), not {window}",
                {"window": shown(window)},
            ) from None
        return window


class BatchService:
    def __init__(self, state: GatewayState, files: FileService, wake: Callable[[], None]) -> None:
        self.redis = state.redis
        self.keys: Keys = state.keys
        self.settings = state.settings
        self.files = files
        self.scripts = ScriptRunner(state.redis)
        self.transitions = BatchTransitions(state.keys)
        self._wake = wake

    async def create(self, body: CreateBatch, caller: Identity) -> BatchObject:
        s = self.settings
        endpoint = _endpoint(body.endpoint)
        try:
            window_s = window_seconds(body.completion_window)
        except ValueError as exc:
            raise BadRequest(str(exc), param="completion_window") from None
        _check_metadata(body.metadata)
        source = await self.files.record(body.input_file_id, caller, "input_file_id")
        if source.purpose != "batch":
            raise BadRequest(
                f"file '{source.id}' has purpose '{source.purpose}'; a batch's input has "
                "purpose 'batch'",
                param="input_file_id",
            )
        others = sorted(set(source.endpoints) - {endpoint})
        if others:
            raise BadRequest(
                f"the input file has lines for {', '.join(others)}; this batch's endpoint is "
                f"{endpoint} (every line's url must be the batch's endpoint)",
                param="endpoint",
            )
        now = time.time()
        record = BatchRecord(
            id=new_batch_id(),
            endpoint=endpoint,
            input_file_id=source.id,
            completion_window=body.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window_s,
            total=source.lines,
            chunks=source.chunks,
            metadata=body.metadata,
            model=source.models[0] if len(source.models) == 1 else None,
            output_ttl_s=(
                body.output_expires_after.seconds if body.output_expires_after else s.file_ttl_s
            ),
            owner=caller.owner,
        )
        await self._write(record, window_s + s.batch_ttl_s)
        log.info("batch created", extra={"batch_id": record.id, "lines": record.total})
        self._wake()
        return record.view()

    async def _write(self, record: BatchRecord, ttl_s: int) -> None:
        """The record and its done stream's group (one slot), then the indexes: a batch is
        driven once it is in the active index, by then whole."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(k.batch(record.id), mapping=record.to_hash())
        pipe.expire(k.batch(record.id), ttl_s)
        pipe.xgroup_create(k.batch_done(record.id), TRACKERS, id="0", mkstream=True)
        pipe.expire(k.batch_done(record.id), ttl_s)
        await pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(k.batches(), {record.id: record.created_at})
        pipe.zadd(k.active_batches(), {record.id: record.expires_at})
        await pipe.execute()

    async def record(self, batch_id: str, caller: Identity | None = None) -> BatchRecord:
        """The batch's record; 404 for one the caller may not see, as for one that is not
        (`caller` None: genq itself)."""
        if not BATCH_ID.fullmatch(batch_id):
            raise _not_found(batch_id)
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        record = BatchRecord.from_hash(raw) if raw else None
        if record is None or (caller is not None and not caller.may_see(record)):
            raise _not_found(batch_id)
        return record

    async def get(self, batch_id: str, caller: Identity) -> BatchObject:
        return (await self.record(batch_id, caller)).view()

    async def listing(self, caller: Identity, *, after: str | None, limit: int) -> ObjectList:
        return await page(
            self.redis,
            self.keys.batches(),
            self._records,
            BatchRecord.view,
            after=after,
            limit=limit,
            keep=caller.may_see,
        )

    async def _records(self, ids: Sequence[str]) -> list[BatchRecord | None]:
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(self.keys.batch(batch_id))
        return [BatchRecord.from_hash(raw) if raw else None for raw in await pipe.execute()]

    async def cancel(self, batch_id: str, caller: Identity) -> BatchObject:
        """Ask for the batch to end `cancelled`: its driver drops the queued requests, stops
        the running ones and writes the files, keeping what finished."""
        await self.record(batch_id, caller)
        fields = BatchRecord.fields(
            status="cancelling", cancelling_at=time.time(), ending="cancelled"
        )
        call = self.transitions.update(
            batch_id, statuses=CANCELLABLE, fields=fields, notify=batch_notify(self.settings)
        )
        reply = await self.scripts.run(call)
        if not reply.done and reply.status not in ("cancelling", "cancelled"):
            raise Conflict(
                f"batch '{batch_id}' is {reply.status}: too late to cancel", param="batch_id"
            )
        if reply.done:
            log.info("batch cancelling", extra={"batch_id": batch_id})
            self._wake()
        return await self.get(batch_id, caller)


async def ensure_group(redis: aioredis.Redis, stream: str) -> None:
    """The trackers' group on a done stream (again, after a Redis that lost it)."""
    try:
        await redis.xgroup_create(stream, TRACKERS, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _endpoint(endpoint: str) -> BatchEndpoint:
    for e in ENDPOINTS:
        if e == endpoint:
            return e
    raise BadRequest(
        f"endpoint is '{endpoint[:64]}'; genq runs batches of {' or '.join(ENDPOINTS)}",
        param="endpoint",
    )


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BadRequest(
            f"metadata has {len(metadata)} keys; the limit is {MAX_METADATA_PAIRS}",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise BadRequest(
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values at "
                f"most {MAX_METADATA_VALUE_CHARS}",
                param=f"metadata.{key[:64]}",
            )


def _not_found(batch_id: str) -> NotFound:
    return NotFound(
        f"no batch {shown(batch_id)} (unknown, or expired)",
        param="batch_id",
        code="batch_not_found",
    )
