"""The worker's own small HTTP/1.1 server (`GENQ_METRICS_PORT`): probes now, /metrics later.

A worker has no web framework, and needs none for a few GET routes read by a kubelet, Docker's
HEALTHCHECK and a metrics scraper. Each connection carries one request (`Connection: close`),
read with a size and time limit so a slow or hostile client holds nothing for long. Routes map
a path to an async handler returning a `Response`; `route()` adds one (e.g. /metrics).

uvicorn is not used here on purpose: its server takes over SIGTERM/SIGINT, which belong to
the worker's drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
"""Request line and headers; more is answered 431."""
READ_TIMEOUT_S = 5.0
"""A client that has not sent its whole request head by then is dropped."""
HANDLER_TIMEOUT_S = 5.0
"""A handler slower than this answers 503 (a probe with a timeout of its own waits no longer)."""
_METHODS = ("GET", "HEAD")


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"

    @classmethod
    def json(cls, status: int, payload: dict[str, Any]) -> Response:
        return cls(status, json.dumps(payload).encode(), "application/json")


Handler = Callable[[], Awaitable[Response]]


def _error(status: HTTPStatus, message: str) -> Response:
    code = status.phrase.lower().replace(" ", "_")
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return Response.json(status, {"error": error})


class HttpServer:
    def __init__(self, host: str | None, port: int) -> None:
        self.host = host
        self.port = port
        self._routes: dict[str, Handler] = {}
        self._server: asyncio.Server | None = None

    def route(self, path: str, handler: Handler) -> None:
        self._routes[path] = handler

    async def start(self) -> None:
        """Bind and serve; an address in use is a clear start-up error, not a silent no-probe."""
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self.port, limit=MAX_HEAD_BYTES
            )
        except OSError as exc:
            msg = f"worker HTTP server cannot listen on port {self.port}: {exc}"
            raise SystemExit(msg) from exc
        log.info("worker HTTP server listening", extra={"port": self.port})

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), READ_TIMEOUT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, response = await self._respond(reader)
            writer.write(_encode(response, head_only=method == "HEAD"))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client left or stalled: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[str, Response]:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            too_large = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
            return "GET", _error(too_large, f"request head over {MAX_HEAD_BYTES} bytes")
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return "GET", _error(HTTPStatus.BAD_REQUEST, "malformed request line")
        method, target, _ = parts
        if method not in _METHODS:
            return method, _error(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} not allowed: GET only")
        handler = self._routes.get(target.split("?", 1)[0])
        if handler is None:
            return method, _error(HTTPStatus.NOT_FOUND, f"no route {target!r}")
        try:
            async with asyncio.timeout(HANDLER_TIMEOUT_S):
                return method, await handler()
        except TimeoutError:
            return method, _error(HTTPStatus.SERVICE_UNAVAILABLE, "handler timed out")
        except Exception:  # a bug in one route must not take the server down
            log.exception("worker HTTP handler failed", extra={"path": target})
            return method, _error(HTTPStatus.INTERNAL_SERVER_ERROR, "handler failed")


def _encode(response: Response, *, head_only: bool) -> bytes:
    status = HTTPStatus(response.status)
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        f"Content-Type: {response.content_type}\r\n"
        f"Content-Length: {len(response.body)}\r\n"
        + ("Allow: GET, HEAD\r\n" if status is HTTPStatus.METHOD_NOT_ALLOWED else "")
        + "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + (b"" if head_only else response.body)
