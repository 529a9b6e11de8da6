"""The Files API: uploads read as they arrive (upload.py: each line checked, the content
stored in whole-line chunks), listing, content, delete; and the files a batch's finalizer
writes. Nothing of an upload is visible until its end: the store commits the content whole,
then the record is written; a refused upload's chunks are dropped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from redis.exceptions import RedisError

from gateway.batch.lines import LineChecker
from gateway.batch.listing import page
from gateway.batch.multipart import PartData, PartEnd, PartStart, boundary_of, form_events
from gateway.batch.storage import ChunkWriter, FileStore
from gateway.batch.upload import Upload, bad_file
from gateway.identity import Identity
from gateway.state import GatewayState
from shared.batches import (
    BATCH_ID,
    FILE_ID,
    FileDeleted,
    FileObject,
    FilePurpose,
    FileRecord,
    ObjectList,
    new_file_id,
    result_file_id,
)
from shared.errors import BadRequest, NotFound, TooLarge, shown

log = logging.getLogger(__name__)

FORM_OVERHEAD_BYTES = 64 * 1024
"""What a multipart body may hold beyond its file (boundaries, headers, small fields)."""
MAX_FIELD_BYTES = 1024
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 86_400
"""OpenAI's bounds on `expires_after[seconds]`."""
UPLOAD_PURPOSES = ("batch",)


class FileService:
    def __init__(self, state: GatewayState, store: FileStore) -> None:
        self.state = state
        self.settings = state.settings
        self.redis = state.redis
        self.keys = state.keys
        self.store = store
        self.checker = LineChecker(state)

    # ---- upload ---------------------------------------------------------------------------

    async def upload(self, request: Request, caller: Identity) -> FileObject:
        s = self.settings
        boundary = boundary_of(request.headers.get("content-type", ""))
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > s.file_max_bytes + FORM_OVERHEAD_BYTES:
            raise TooLarge(
                f"the upload is {length} bytes; files are at most {s.file_max_bytes} bytes "
                "(GENQ_FILE_MAX_BYTES)",
                param="file",
                code="file_too_large",
            )
        file_id = new_file_id()
        writer = self.store.writer(file_id)
        try:
            upload, fields = await self._receive(request, boundary, writer)
            purpose = _purpose(fields)
            ttl_s = _ttl(fields, s.file_ttl_s)
            if upload.problems:
                raise bad_file(upload.problems)
            if upload.requests == 0:
                raise BadRequest("the file holds no request lines", param="file")
            now = time.time()
            record = FileRecord(
                id=file_id,
                filename=upload.filename,
                purpose=purpose,
                owner=caller.owner,
                bytes=upload.size,
                created_at=now,
                expires_at=now + ttl_s,
                lines=upload.requests,
                chunks=upload.chunks,
                endpoints=sorted(upload.endpoints),
                models=sorted(upload.models),
            )
            await writer.commit(ttl_s)
        except BaseException:
            with contextlib.suppress(RedisError, OSError):
                await writer.abort()
            raise
        await self._save(record, ttl_s)
        log.info("file uploaded", extra={"file_id": file_id, "lines": record.lines})
        return record.view()

    async def _receive(
        self, request: Request, boundary: bytes, writer: ChunkWriter
    ) -> tuple[Upload, dict[str, str]]:
        """Read the form: the `file` part into an upload, the other (small) fields as text."""
        upload: Upload | None = None
        fields: dict[str, str] = {}
        current: str | None = None
        value = bytearray()
        async for event in form_events(request.stream(), boundary):
            if isinstance(event, PartStart):
                current, value = event.name, bytearray()
                if current == "file":
                    if upload is not None:
                        raise BadRequest("the form holds more than one file", param="file")
                    upload = Upload(
                        self.settings, self.checker, writer, event.filename or "upload.jsonl"
                    )
            elif isinstance(event, PartData):
                if current == "file" and upload is not None:
                    await upload.feed(event.data)
                elif len(value) + len(event.data) <= MAX_FIELD_BYTES:
                    value += event.data
            elif isinstance(event, PartEnd):
                if current == "file" and upload is not None:
                    await upload.finish()
                elif current is not None:
                    fields[current] = value.decode(errors="replace")
                current = None
        if upload is None:
            raise BadRequest("the form has no `file` field", param="file")
        return upload, fields

    async def _save(self, record: FileRecord, ttl_s: int) -> None:
        pipe = self.redis.pipeline(transaction=False)
        key = self.keys.file(record.id)
        pipe.hset(key, mapping=record.to_hash())
        pipe.expire(key, ttl_s)
        pipe.zadd(self.keys.files(), {record.id: record.created_at})
        await pipe.execute()

    # ---- the files a batch writes ---------------------------------------------------------

    async def write_output(
        self,
        file_id: str,
        filename: str,
        chunks: AsyncIterator[tuple[bytes, int]],
        ttl_s: int,
        *,
        owner: str | None,
    ) -> FileRecord | None:
        """Store a file of `(chunk, lines in it)` for `owner` (its batch's); None (nothing
        stored) if it has no lines. Written again under the same id, it replaces the earlier
        content whole."""
        writer = self.store.writer(file_id)
        size, counts = 0, []
        try:
            async for chunk, lines in chunks:
                await writer.append(chunk)
                size += len(chunk)
                counts.append(lines)
            if not counts:
                await writer.abort()
                return None
            await writer.commit(ttl_s)
        except BaseException:
            with contextlib.suppress(RedisError, OSError):
                await writer.abort()
            raise
        now = time.time()
        record = FileRecord(
            id=file_id,
            filename=filename,
            purpose="batch_output",
            owner=owner,
            bytes=size,
            created_at=now,
            expires_at=now + ttl_s,
            lines=sum(counts),
            chunks=counts,
        )
        await self._save(record, ttl_s)
        return record

    # ---- look up, list, read, delete ------------------------------------------------------

    async def record(
        self, file_id: str, caller: Identity | None, param: str = "file_id"
    ) -> FileRecord:
        """The file's record; 404 for one the caller may not see, as for one that is not
        (`caller` None: genq itself)."""
        if not FILE_ID.fullmatch(file_id):
            raise _not_found(file_id, param)
        raw = await self.redis.hgetall(self.keys.file(file_id))
        [record] = await self._owned([FileRecord.from_hash(raw) if raw else None])
        if record is None or (caller is not None and not caller.may_see(record)):
            raise _not_found(file_id, param)
        return record

    async def get(self, file_id: str, caller: Identity) -> FileObject:
        return (await self.record(file_id, caller)).view()

    async def listing(
        self,
        caller: Identity,
        *,
        after: str | None,
        limit: int,
        newest_first: bool,
        purpose: str | None,
    ) -> ObjectList:
        return await page(
            self.redis,
            self.keys.files(),
            self._records,
            FileRecord.view,
            after=after,
            limit=limit,
            newest_first=newest_first,
            keep=lambda r: (purpose is None or r.purpose == purpose) and caller.may_see(r),
        )

    async def _records(self, ids: Sequence[str]) -> list[FileRecord | None]:
        pipe = self.redis.pipeline(transaction=False)
        for file_id in ids:
            pipe.hgetall(self.keys.file(file_id))
        return await self._owned(
            [FileRecord.from_hash(raw) if raw else None for raw in await pipe.execute()]
        )

    async def _owned(self, records: list[FileRecord | None]) -> list[FileRecord | None]:
        """Output and error files written without their batch's owner (as genq once wrote
        them) take it now, from the batch whose results they hold: their id follows from the
        batch's (`result_file_id`), so no other file can claim a batch. One whose batch has
        expired keeps no owner: admins alone see it (`Identity.may_see`)."""
        orphans = [(i, b) for i, r in enumerate(records) if r and (b := _batch_of_result(r))]
        if not orphans:
            return records
        pipe = self.redis.pipeline(transaction=False)
        for _, batch_id in orphans:
            pipe.hget(self.keys.batch(batch_id), "owner")
        out = list(records)
        for (i, _), owner in zip(orphans, await pipe.execute(), strict=True):
            record = records[i]
            if owner is not None and record is not None:
                out[i] = record.model_copy(update={"owner": owner})
        return out

    async def content(self, file_id: str, caller: Identity) -> AsyncIterator[bytes]:
        await self.record(file_id, caller)  # 404 first, before a streamed response begins
        return self.store.chunks(file_id)

    async def delete(self, file_id: str, caller: Identity) -> FileDeleted:
        await self.record(file_id, caller)
        await self.store.delete(file_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.file(file_id))
        pipe.zrem(self.keys.files(), file_id)
        await pipe.execute()
        return FileDeleted(id=file_id)


def _batch_of_result(record: FileRecord) -> str | None:
    """The batch whose output or error file this owner-less record is; None for any other."""
    if record.owner is not None or record.purpose != "batch_output":
        return None
    batch_id = "_".join(record.filename.split("_", 2)[:2])  # named `batch_<hex>_….jsonl`
    if not BATCH_ID.fullmatch(batch_id):
        return None
    ids = (result_file_id(batch_id, "out"), result_file_id(batch_id, "err"))
    return batch_id if record.id in ids else None


def _not_found(file_id: str, param: str) -> NotFound:
    return NotFound(
        f"no file {shown(file_id)} (unknown, deleted or expired)",
        param=param,
        code="file_not_found",
    )


def _purpose(fields: dict[str, str]) -> FilePurpose:
    purpose = fields.get("purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise BadRequest(
            f"purpose is {purpose!r}; genq stores files for batches: purpose 'batch'",
            param="purpose",
        )
    return "batch"


def _ttl(fields: dict[str, str], default: int) -> int:
    """`expires_after[seconds]` (anchor `created_at`), OpenAI's bounds; else the default."""
    seconds = fields.get("expires_after[seconds]")
    if seconds is None:
        return default
    anchor = fields.get("expires_after[anchor]", "created_at")
    if anchor != "created_at" or not seconds.isdigit():
        raise BadRequest(
            "expires_after is {anchor: 'created_at', seconds: <int>}", param="expires_after"
        )
    ttl = int(seconds)
    if not MIN_EXPIRES_AFTER_S <= ttl <= MAX_EXPIRES_AFTER_S:
        raise BadRequest(
            f"expires_after.seconds is {ttl}; it is {MIN_EXPIRES_AFTER_S} to {MAX_EXPIRES_AFTER_S}",
            param="expires_after.seconds",
        )
    return ttl
