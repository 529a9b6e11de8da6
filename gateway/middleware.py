"""ASGI middleware that guards a request before any route sees it: the API key is checked and
the body's size bounded before a byte of the body is parsed.

FastAPI reads and parses a body before a route's dependencies run, so a key checked only in a
dependency would let anyone make the gateway parse a 50 MB body before answering 401.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth_throttle import AuthThrottle, client_of
from gateway.deps import check_key, presented_key
from gateway.http_errors import error_response
from shared.errors import PayloadTooLarge, Unauthorized
from shared.settings import GatewaySettings

PROTECTED_PREFIX = "/v1/"
"""Every route under it needs a key when keys are set; health probes and /docs do not."""


class Authenticate:
    """With API keys set, a request under /v1/ without an accepted key is answered 401 at once
    (429 once its address is past GENQ_AUTH_FAIL_LIMIT failures: `AuthThrottle`)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings, throttle: AuthThrottle) -> None:
        self.app = app
        self.settings = settings
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and f"{scope['path']}/".startswith(PROTECTED_PREFIX):
            headers = Request(scope).headers
            token = presented_key(headers.get("authorization"), headers.get("x-api-key"))
            try:
                check_key(self.settings, token)
            except Unauthorized as exc:
                refused = self.throttle.failed(client_of(scope))
                await error_response(refused or exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


UPLOAD_PATH = "/v1/files"
UPLOAD_FORM_BYTES = 64 * 1024
"""Room for a body's framing beyond its limit (a multipart form's boundaries and fields): the
upload's own check (gateway/batch) counts the file's bytes exactly."""


class BodyLimit:
    """A body over `limit` bytes is refused with 413: at once when Content-Length says so, else
    as soon as the bytes received pass it (a chunked body), before the rest is read."""

    def __init__(self, app: ASGIApp, limit: int, uploads: int) -> None:
        self.app = app
        self.limit = limit
        self.uploads = uploads
        """A file upload's limit (POST /v1/files: GENQ_FILE_MAX_BYTES, its own 413 besides)."""

    def _limit_of(self, scope: Scope) -> tuple[int, int, str]:
        """(bytes allowed, the limit to name, its setting)."""
        if scope.get("method") == "POST" and scope.get("path") == UPLOAD_PATH:
            return self.uploads + UPLOAD_FORM_BYTES, self.uploads, "GENQ_FILE_MAX_BYTES"
        return self.limit, self.limit, "GENQ_MAX_BODY_BYTES"

    def _too_large(self, limit: int, setting: str) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body is over {limit} bytes, the limit ({setting})", param="body"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allowed, limit, setting = self._limit_of(scope)
        declared = Request(scope).headers.get("content-length", "")
        if declared.isdigit() and int(declared) > allowed:
            await error_response(self._too_large(limit, setting))(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > allowed:
                    raise self._too_large(limit, setting)
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
