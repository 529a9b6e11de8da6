"""The Files API: uploads read as they arrive (each line checked, the content stored in
whole-line chunks), listing, content, delete; and the files a batch's finalizer writes.

An upload is checked and stored in one pass: lines are split off the multipart stream, checked
in groups (`CHECK_GROUP`, yielding to the event loop between groups: tokenizing 50,000 prompts
is CPU work) and appended to a chunk, which goes to the store when full. Nothing is visible
until the end: the store commits the content whole, then the record is written. A bad file is
a 400 naming its first bad lines (`PROBLEMS_SHOWN`), a file over a limit a 413 naming the
limit; either way the stored chunks are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from redis.exceptions import RedisError

from gateway.batch.lines import LineChecker, LineProblem, PreparedLine
from gateway.batch.listing import page
from gateway.batch.multipart import PartData, PartEnd, PartStart, boundary_of, form_events
from gateway.batch.storage import ChunkWriter, FileStore
from gateway.state import GatewayState
from shared.batches import (
    FILE_ID,
    FileDeleted,
    FileObject,
    FilePurpose,
    FileRecord,
    ObjectList,
    new_file_id,
)
from shared.errors import BadRequest, NotFound, TooLarge

log = logging.getLogger(__name__)

CHECK_GROUP = 128
"""Lines checked between two yields to the event loop."""
PROBLEMS_SHOWN = 10
"""A bad file's 400 names this many of its first bad lines; checking stops there."""
FORM_OVERHEAD_BYTES = 64 * 1024
"""What a multipart body may hold beyond its file (boundaries, headers, small fields)."""
MAX_FIELD_BYTES = 1024
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 86_400
"""OpenAI's bounds on `expires_after[seconds]`."""
UPLOAD_PURPOSES = ("batch",)


@dataclass
class _Upload:
    """One upload in progress: its lines split off, checked and stored as they arrive."""

    files: FileService
    writer: ChunkWriter
    filename: str
    size: int = 0
    requests: int = 0
    """Request lines so far (the last non-blank line's number)."""
    line_no: int = 0
    pending: bytearray = field(default_factory=bytearray)
    """The line being received (no newline yet)."""
    unchecked: list[tuple[int, bytes]] = field(default_factory=list)
    chunk: bytearray = field(default_factory=bytearray)
    chunk_lines: int = 0
    chunks: list[int] = field(default_factory=list)
    blank: int | None = None
    """A blank line not yet known to be trailing (an error if a request follows)."""
    problems: list[LineProblem] = field(default_factory=list)
    custom_ids: dict[str, int] = field(default_factory=dict)
    endpoints: set[str] = field(default_factory=set)
    models: set[str] = field(default_factory=set)

    @property
    def failed(self) -> bool:
        return len(self.problems) >= PROBLEMS_SHOWN

    async def feed(self, data: bytes) -> None:
        s = self.files.settings
        self.size += len(data)
        if self.size > s.file_max_bytes:
            raise TooLarge(
                f"the file is over {s.file_max_bytes} bytes, the limit (GENQ_FILE_MAX_BYTES)",
                param="file",
                code="file_too_large",
            )
        self.pending += data
        end = self.pending.rfind(b"\n")
        if end < 0:
            return
        complete = bytes(self.pending[: end + 1])
        del self.pending[: end + 1]
        for raw in complete.split(b"\n")[:-1]:
            await self._line(raw, b"\n")

    async def finish(self) -> None:
        if self.pending:
            await self._line(bytes(self.pending), b"")
            self.pending.clear()
        await self._check()
        await self._flush()

    async def _line(self, raw: bytes, newline: bytes) -> None:
        self.line_no += 1
        text = raw.rstrip(b"\r")
        if not text.strip():
            self.blank = self.blank or self.line_no
        else:
            self._request(text)
        if not self.failed:
            self.chunk += raw + newline
            self.chunk_lines += 1
            if len(self.chunk) >= self.files.settings.file_chunk_bytes:
                await self._flush()
        if len(self.unchecked) >= CHECK_GROUP:
            await self._check()

    def _request(self, text: bytes) -> None:
        s = self.files.settings
        if self.blank is not None:
            self._problem(LineProblem(self.blank, None, "empty; only the file's end may be blank"))
            self.blank = None
        self.requests = self.line_no
        if self.requests > s.batch_max_lines:
            raise TooLarge(
                f"the file holds more than {s.batch_max_lines} requests, the limit "
                "(GENQ_BATCH_MAX_LINES)",
                param="file",
                code="too_many_lines",
            )
        if not self.failed:
            self.unchecked.append((self.line_no, text))

    async def _check(self) -> None:
        group, self.unchecked = self.unchecked, []
        for line, text in group:
            if self.failed:
                return
            result = await self.files.checker.check(line, text)
            if isinstance(result, LineProblem):
                self._problem(result)
            else:
                self._accept(result)
        await asyncio.sleep(0)  # tokenizing is CPU work: let the loop serve others meanwhile

    def _accept(self, p: PreparedLine) -> None:
        first = self.custom_ids.setdefault(p.request.custom_id, p.line)
        if first != p.line:
            self._problem(
                LineProblem(
                    p.line,
                    "custom_id",
                    f"'{p.request.custom_id[:64]}' is the custom_id of line {first} already; "
                    "custom_ids are unique in a file",
                    "duplicate_custom_id",
                )
            )
        self.endpoints.add(p.request.url)
        self.models.add(p.spec.model)

    def _problem(self, problem: LineProblem) -> None:
        if not self.failed:
            self.problems.append(problem)

    async def _flush(self) -> None:
        if self.chunk and not self.failed:
            await self.writer.append(bytes(self.chunk))
            self.chunks.append(self.chunk_lines)
        self.chunk.clear()
        self.chunk_lines = 0


class FileService:
    def __init__(self, state: GatewayState, store: FileStore) -> None:
        self.state = state
        self.settings = state.settings
        self.redis = state.redis
        self.keys = state.keys
        self.store = store
        self.checker = LineChecker(state)

    # ---- upload ---------------------------------------------------------------------------

    async def upload(self, request: Request) -> FileObject:
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
                raise _bad_file(upload.problems)
            if upload.requests == 0:
                raise BadRequest("the file holds no request lines", param="file")
            now = time.time()
            record = FileRecord(
                id=file_id,
                filename=upload.filename,
                purpose=purpose,
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
    ) -> tuple[_Upload, dict[str, str]]:
        """Read the form: the `file` part into an upload, the other (small) fields as text."""
        upload: _Upload | None = None
        fields: dict[str, str] = {}
        current: str | None = None
        value = bytearray()
        async for event in form_events(request.stream(), boundary):
            if isinstance(event, PartStart):
                current, value = event.name, bytearray()
                if current == "file":
                    if upload is not None:
                        raise BadRequest("the form holds more than one file", param="file")
                    upload = _Upload(self, writer, event.filename or "upload.jsonl")
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
        self, file_id: str, filename: str, chunks: AsyncIterator[tuple[bytes, int]], ttl_s: int
    ) -> FileRecord | None:
        """Store a file of `(chunk, lines in it)`; None (nothing stored) if it has no lines.
        Written again under the same id, it replaces the earlier content whole."""
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
            bytes=size,
            created_at=now,
            expires_at=now + ttl_s,
            lines=sum(counts),
            chunks=counts,
        )
        await self._save(record, ttl_s)
        return record

    # ---- look up, list, read, delete ------------------------------------------------------

    async def record(self, file_id: str, param: str = "file_id") -> FileRecord:
        if not FILE_ID.fullmatch(file_id):
            raise _not_found(file_id, param)
        raw = await self.redis.hgetall(self.keys.file(file_id))
        if not raw:
            raise _not_found(file_id, param)
        return FileRecord.from_hash(raw)

    async def get(self, file_id: str) -> FileObject:
        return (await self.record(file_id)).view()

    async def listing(
        self, *, after: str | None, limit: int, newest_first: bool, purpose: str | None
    ) -> ObjectList:
        return await page(
            self.redis,
            self.keys.files(),
            self._records,
            FileRecord.view,
            after=after,
            limit=limit,
            newest_first=newest_first,
            keep=lambda r: purpose is None or r.purpose == purpose,
        )

    async def _records(self, ids: Sequence[str]) -> list[FileRecord | None]:
        pipe = self.redis.pipeline(transaction=False)
        for file_id in ids:
            pipe.hgetall(self.keys.file(file_id))
        return [FileRecord.from_hash(raw) if raw else None for raw in await pipe.execute()]

    async def content(self, file_id: str) -> AsyncIterator[bytes]:
        await self.record(file_id)  # 404 first, before a streamed response begins
        return self.store.chunks(file_id)

    async def delete(self, file_id: str) -> FileDeleted:
        await self.record(file_id)
        await self.store.delete(file_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.file(file_id))
        pipe.zrem(self.keys.files(), file_id)
        await pipe.execute()
        return FileDeleted(id=file_id)


def _not_found(file_id: str, param: str) -> NotFound:
    return NotFound(
        f"no file '{file_id[:64]}' (unknown, deleted or expired)",
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


def _bad_file(problems: list[LineProblem]) -> BadRequest:
    shown = "; ".join(p.describe() for p in problems)
    more = " (and maybe more: checking stops there)" if len(problems) >= PROBLEMS_SHOWN else ""
    first = problems[0]
    return BadRequest(
        f"the file has bad lines{more}: {shown}",
        param=f"line {first.line}" + (f": {first.param}" if first.param else ""),
        code="invalid_batch_file",
    )
