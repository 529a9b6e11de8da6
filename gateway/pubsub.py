"""One pub/sub connection per gateway process, multiplexing every stream it serves.

Streams subscribe a channel and get a `Subscription`: a buffer that the single receive loop
fills and wakes. A stream drains everything buffered at once, so a burst becomes one write.
Live messages are only a fast path: streams detect gaps by `seq` and fill them from the
event log, so a message lost in a reconnect costs latency, never data.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("genq.gateway.pubsub")
_RECONNECT_BACKOFF_MAX_S = 2.0


class Subscription:
    __slots__ = ("_router", "buffer", "channel", "wake")

    def __init__(self, router: PubSubRouter, channel: str) -> None:
        self._router = router
        self.channel = channel
        self.buffer: collections.deque[str] = collections.deque()
        self.wake = asyncio.Event()

    def take(self) -> list[str]:
        self.wake.clear()
        items = list(self.buffer)
        self.buffer.clear()
        return items

    async def close(self) -> None:
        await self._router.unsubscribe(self)


class PubSubRouter:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self._subs: dict[str, set[Subscription]] = {}
        self._has_channels = asyncio.Event()
        self._lock = asyncio.Lock()

    @property
    def channels(self) -> int:
        return len(self._subs)

    async def subscribe(self, channel: str) -> Subscription:
        sub = Subscription(self, channel)
        async with self._lock:
            subs = self._subs.get(channel)
            if subs is None:
                # Registered only once SUBSCRIBE went out: a failed one must not leave the
                # channel looking subscribed to the next stream of the same job.
                await self._pubsub.subscribe(channel)
                self._subs[channel] = subs = set()
                self._has_channels.set()
            subs.add(sub)
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        async with self._lock:
            subs = self._subs.get(sub.channel)
            if subs is None:
                return
            subs.discard(sub)
            if not subs:
                del self._subs[sub.channel]
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.unsubscribe(sub.channel)

    async def run(self) -> None:
        """Receive forever; on a broken connection, back off and resubscribe everything."""
        backoff = 0.05
        while True:
            await self._has_channels.wait()
            try:
                while True:
                    msg = await self._pubsub.get_message(timeout=None)
                    if msg is not None and msg["type"] == "message":
                        self._dispatch(msg["channel"], msg["data"])
                    backoff = 0.05
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, RuntimeError) as exc:
                log.warning("pub/sub receive failed; reconnecting", extra={"error": str(exc)})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _RECONNECT_BACKOFF_MAX_S)
                await self._resubscribe()

    def _dispatch(self, channel: str, data: str) -> None:
        for sub in self._subs.get(channel, ()):
            sub.buffer.append(data)
            sub.wake.set()

    async def _resubscribe(self) -> None:
        async with self._lock:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()
                if self._subs:
                    await self._pubsub.subscribe(*self._subs)
        for subs in self._subs.values():  # let every stream re-read its log
            for sub in subs:
                sub.wake.set()

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()
