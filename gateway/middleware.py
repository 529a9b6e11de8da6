"""ASGI middleware that guards a request before any route sees it: the API key is checked and
the body's size bounded before a byte of the body is parsed.

FastAPI reads and parses a body before a route's dependencies run, so a key checked only in a
dependency would let anyone make the gateway parse a 50 MB body before answering 401.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.deps import check_key, presented_key
from gateway.http_errors import error_response
from shared.errors import PayloadTooLarge, Unauthorized
from shared.settings import GatewaySettings

PROTECTED_PREFIX = "/v1/"
"""Every route under it needs a key when keys are set; health probes and /docs do not."""


class Authenticate:
    """With API keys set, a request under /v1/ without an accepted key is answered 401 at once."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and f"{scope['path']}/".startswith(PROTECTED_PREFIX):
            headers = Request(scope).headers
            token = presented_key(headers.get("authorization"), headers.get("x-api-key"))
            try:
                check_key(self.settings, token)
            except Unauthorized as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """A body over `limit` bytes is refused with 413: at once when Content-Length says so, else
    as soon as the bytes received pass it (a chunked body), before the rest is read."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body is over {self.limit} bytes, the limit (GENQ_MAX_BODY_BYTES)",
            param="body",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Request(scope).headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise self._too_large()
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except PayloadTooLarge as exc:  # read outside FastAPI's body parsing
            if started:
                raise
            await error_response(exc)(scope, receive, send)
