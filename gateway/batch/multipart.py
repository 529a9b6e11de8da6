"""A multipart/form-data body read as it arrives: the parts' headers and their data in pieces,
so an upload goes to storage without the whole file ever being held (python-multipart's
push parser, driven from the request's byte stream)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from shared.errors import BadRequest

FORM_CONTENT_TYPE = b"multipart/form-data"


@dataclass(frozen=True, slots=True)
class PartStart:
    name: str
    filename: str | None


@dataclass(frozen=True, slots=True)
class PartData:
    data: bytes


@dataclass(frozen=True, slots=True)
class PartEnd:
    pass


FormEvent = PartStart | PartData | PartEnd


def boundary_of(content_type: str) -> bytes:
    """The boundary of a multipart/form-data body; a 400 for any other body."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != FORM_CONTENT_TYPE or not boundary:
        raise BadRequest(
            "an upload is a multipart/form-data body with the fields `file` and `purpose`",
            param="file",
        )
    return boundary


class _Collector:
    """The parser's callbacks, gathering events for the reader to hand out."""

    def __init__(self) -> None:
        self.events: list[FormEvent] = []
        self._headers: dict[bytes, bytes] = {}
        self._field = bytearray()
        self._value = bytearray()

    def on_part_begin(self) -> None:
        self._headers = {}

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[bytes(self._field).lower()] = bytes(self._value)
        self._field.clear()
        self._value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode(errors="replace")
        filename = options.get(b"filename")
        self.events.append(
            PartStart(name, None if filename is None else filename.decode(errors="replace"))
        )

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self.events.append(PartData(data[start:end]))

    def on_part_end(self) -> None:
        self.events.append(PartEnd())


async def form_events(body: AsyncIterator[bytes], boundary: bytes) -> AsyncIterator[FormEvent]:
    """The events of a multipart body, in order, as its bytes arrive."""
    collector = _Collector()
    callbacks = {
        name: getattr(collector, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
            "on_part_data",
            "on_part_end",
        )
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    async for piece in body:
        try:
            parser.write(piece)
        except MultipartParseError as exc:
            raise BadRequest(f"the multipart body does not parse: {exc}", param="file") from None
        events, collector.events = collector.events, []
        for event in events:
            yield event
    try:
        parser.finalize()
    except MultipartParseError as exc:
        raise BadRequest(f"the multipart body does not parse: {exc}", param="file") from None
