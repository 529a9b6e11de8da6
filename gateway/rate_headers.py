"""OpenAI's rate-limit headers on every answer to a keyed request whose key has a request rate
or a tokens-per-minute limit: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`.

What they say comes from the checks the request runs anyway (no Redis call of their own):
the request rate's script reads both of the key's buckets, SUBMIT tells the tokens bucket's
level after it charged a job. They are gathered while the request runs in a context variable
the middleware sets (`seen`), and added when the answer starts, whatever answers: the route,
an error handler, a stream. A bucket's `limit` is its size (requests a key may make at once;
its tokens per minute), `remaining` what it holds, `reset` the time until it is full again,
written as OpenAI writes durations (`1s`, `6m0s`, `20ms`).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.transitions import Bucket

HEADERS = tuple(
    f"x-ratelimit-{what}-{unit}"
    for unit in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
)
"""Every header this module may send (CORS exposes them)."""
_MS_PER_S, _S_PER_M, _M_PER_H = 1000, 60, 60


@dataclass(slots=True)
class Seen:
    """A request's buckets, as the last check that read them left them (None: not read)."""

    requests: Bucket | None = None
    tokens: Bucket | None = None

    def headers(self) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        for unit, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out += [
                    (f"x-ratelimit-limit-{unit}".encode(), str(bucket.limit).encode()),
                    (f"x-ratelimit-remaining-{unit}".encode(), str(bucket.remaining).encode()),
                    (f"x-ratelimit-reset-{unit}".encode(), duration(bucket.reset_ms).encode()),
                ]
        return out


_seen: ContextVar[Seen | None] = ContextVar("genq_rate_seen", default=None)


def seen() -> Seen:
    """The buckets the request being served has read so far (an empty record outside a
    request, or in an app without the middleware: nothing is sent)."""
    return _seen.get() or Seen()


def note(requests: Bucket | None = None, tokens: Bucket | None = None) -> None:
    """What a check just read of the caller's buckets (None: not read by this check)."""
    current = _seen.get()
    if current is None:
        return
    if requests is not None:
        current.requests = requests
    if tokens is not None:
        current.tokens = tokens


def duration(ms: int) -> str:
    """`ms` as OpenAI writes a reset (Go's duration format): `0s`, `20ms`, `1.5s`, `6m0s`,
    `1h2m3.004s`."""
    if ms <= 0:
        return "0s"
    if ms < _MS_PER_S:
        return f"{ms}ms"
    seconds, millis = divmod(ms, _MS_PER_S)
    minutes, seconds = divmod(seconds, _S_PER_M)
    hours, minutes = divmod(minutes, _M_PER_H)
    text = f"{seconds}.{millis:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


class RateHeaders:
    """Adds what the request's checks saw of its key's buckets to the answer's headers.
    Installed only while some key has a rate limit (`per_key_rates`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        current = Seen()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = current.headers()
                if extra:
                    message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        token = _seen.set(current)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _seen.reset(token)
