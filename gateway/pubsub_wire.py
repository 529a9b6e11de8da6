"""Pub/sub connections for the gateway's router: a lean raw one, and redis-py's as fallback.

The raw connection is an asyncio Protocol that parses with hiredis and hands each message
to the router straight from `data_received`: no task wake-up, no await, no per-message
wrapper objects. redis-py's PubSub costs several times more per message, and the gateway
handles one message per job per worker flush, so this is its hottest path. The fallback
(`RedisPyPubSub`) serves in-process fakeredis and anything the raw one cannot reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import Protocol, cast

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

OnMessage = Callable[[str, str], None]
_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 2.0
_POLL_S = 1.0


class PubSubBackend(Protocol):
    immediate: bool
    """True when (un)subscribe only writes to a socket buffer: no batching needed."""

    async def run(self, on_message: OnMessage, on_reconnect: Callable[[], None]) -> None: ...

    async def subscribe(self, *channels: str) -> None: ...

    async def unsubscribe(self, *channels: str) -> None: ...

    async def close(self) -> None: ...


def _pack(*parts: str) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RawPubSub(asyncio.Protocol):
    """One Redis connection in subscribed mode; reconnects and resubscribes by itself."""

    immediate = True

    def __init__(self, url: str, connect_timeout_s: float, name: str = "genq-gateway") -> None:
        opts = parse_url(url)
        self.name = name
        self._host = str(opts.get("host", "127.0.0.1"))
        self._port = int(opts.get("port", 6379))
        self._auth = [a for a in (opts.get("username"), opts.get("password")) if a]
        self._ssl = (
            ssl.create_default_context() if opts.get("connection_class") is SSLConnection else None
        )
        self._timeout = connect_timeout_s
        self._channels: set[str] = set()
        self._transport: asyncio.Transport | None = None
        self._outbox: list[bytes] = []
        self._reader = hiredis.Reader(encoding="utf-8", errors="replace")
        self._lost: asyncio.Future[None] | None = None
        self._on_message: OnMessage = lambda c, d: None
        self._closed = False

    async def run(self, on_message: OnMessage, on_reconnect: Callable[[], None]) -> None:
        self._on_message = on_message
        loop = asyncio.get_running_loop()
        backoff, first = _BACKOFF_START_S, True
        while not self._closed:
            # Made here, not in connection_made: uvloop calls that only after
            # create_connection has returned.
            lost: asyncio.Future[None] = loop.create_future()
            self._lost = lost
            try:
                async with asyncio.timeout(self._timeout):
                    await loop.create_connection(
                        lambda: self, self._host, self._port, ssl=self._ssl
                    )
            except (OSError, TimeoutError) as exc:
                log.warning("pub/sub connect failed; retrying", extra={"error": str(exc)})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            backoff = _BACKOFF_START_S
            if self._closed and self._transport is not None:  # closed while connecting
                self._transport.close()
                return
            if not first:
                on_reconnect()  # messages may have been missed: streams re-read their logs
            first = False
            await lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = cast(asyncio.Transport, transport)  # uvloop's transports are no asyncio.Transport
        self._transport = t
        self._reader = hiredis.Reader(encoding="utf-8", errors="replace")
        self._outbox = []  # superseded by the full SUBSCRIBE below
        if self._auth:
            t.write(_pack("AUTH", *self._auth))
        t.write(_pack("CLIENT", "SETNAME", self.name))  # visible in CLIENT LIST
        if self._channels:
            t.write(_pack("SUBSCRIBE", *self._channels))

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            if isinstance(reply, list) and reply and reply[0] == "message":
                self._on_message(reply[1], reply[2])
            elif isinstance(reply, hiredis.ReplyError):
                log.warning("pub/sub error reply", extra={"error": str(reply)})

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        if not self._closed:
            log.warning("pub/sub connection lost; reconnecting", extra={"error": str(exc)})

    async def subscribe(self, *channels: str) -> None:
        """Written at once: the caller queues its job next and wants to be listening first."""
        self._channels.update(channels)
        if self._transport is not None:
            self._outbox.append(_pack("SUBSCRIBE", *channels))
            self._write_out()

    async def unsubscribe(self, *channels: str) -> None:
        self._channels.difference_update(channels)
        self._queue(_pack("UNSUBSCRIBE", *channels))

    def _queue(self, command: bytes) -> None:
        """Write at the end of this loop iteration: one syscall for every stream that ended
        in it."""
        if self._transport is None:
            return  # sent with the whole channel set on (re)connect
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._write_out)
        self._outbox.append(command)

    def _write_out(self) -> None:
        data, self._outbox = b"".join(self._outbox), []
        if self._transport is not None and data:
            self._transport.write(data)

    async def close(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.close()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)


class RedisPyPubSub:
    """redis-py's PubSub behind the same interface (fakeredis, tests)."""

    immediate = False

    def __init__(self, redis: aioredis.Redis) -> None:
        self._pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self._channels: set[str] = set()
        self._has_channels = asyncio.Event()
        self._closed = False

    async def run(self, on_message: OnMessage, on_reconnect: Callable[[], None]) -> None:
        backoff = _BACKOFF_START_S
        while not self._closed:
            await self._has_channels.wait()
            try:
                while not self._closed:
                    # A timeout, not a blocking read: some clients swallow a cancel while
                    # blocked, and the loop must notice `close()`.
                    msg = await self._pubsub.get_message(timeout=_POLL_S)
                    if msg is not None and msg["type"] == "message":
                        on_message(msg["channel"], msg["data"])
                    backoff = _BACKOFF_START_S
            except (RedisError, OSError, RuntimeError) as exc:
                if self._closed:
                    return
                log.warning("pub/sub receive failed; reconnecting", extra={"error": str(exc)})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.aclose()
                    if self._channels:
                        await self._pubsub.subscribe(*self._channels)
                on_reconnect()

    async def subscribe(self, *channels: str) -> None:
        self._channels.update(channels)
        await self._pubsub.subscribe(*channels)
        self._has_channels.set()

    async def unsubscribe(self, *channels: str) -> None:
        self._channels.difference_update(channels)
        await self._pubsub.unsubscribe(*channels)

    async def close(self) -> None:
        self._closed = True
        self._has_channels.set()
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()
