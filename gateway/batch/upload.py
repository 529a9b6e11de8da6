"""One upload in progress, checked and stored in one pass.

Lines are split off the multipart stream as it arrives, checked in groups (`CHECK_GROUP`,
yielding to the event loop between groups: tokenizing 50,000 prompts is CPU work) and
appended to a chunk, which goes to the store when full (GENQ_FILE_CHUNK_BYTES); so at most a
chunk and a line of the file are in memory. A bad file is a 400 naming its first bad lines
(`PROBLEMS_SHOWN`; checking and storing stop there), a file over a limit a 413 naming it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.batch.lines import LineChecker, LineProblem, PreparedLine
from gateway.batch.storage import ChunkWriter
from shared.errors import BadRequest, TooLarge
from shared.settings import GatewaySettings

CHECK_GROUP = 128
"""Lines checked between two yields to the event loop."""
PROBLEMS_SHOWN = 10
"""A bad file's 400 names this many of its first bad lines; checking stops there."""


@dataclass
class Upload:
    """One upload in progress: its lines split off, checked and stored as they arrive."""

    settings: GatewaySettings
    checker: LineChecker
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
        s = self.settings
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
            if len(self.chunk) >= self.settings.file_chunk_bytes:
                await self._flush()
        if len(self.unchecked) >= CHECK_GROUP:
            await self._check()

    def _request(self, text: bytes) -> None:
        s = self.settings
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
            result = await self.checker.check(line, text)
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


def bad_file(problems: list[LineProblem]) -> BadRequest:
    shown = "; ".join(p.describe() for p in problems)
    more = " (and maybe more: checking stops there)" if len(problems) >= PROBLEMS_SHOWN else ""
    first = problems[0]
    return BadRequest(
        f"the file has bad lines{more}: {shown}",
        param=f"line {first.line}" + (f": {first.param}" if first.param else ""),
        code="invalid_batch_file",
    )
