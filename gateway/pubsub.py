"""One pub/sub connection per gateway process, multiplexing every stream it serves.

Streams subscribe a channel and get a `Subscription`: a buffer that the single receive loop
fills and wakes. A stream drains everything buffered at once, so a burst becomes one write.
Live messages are only a fast path: streams detect gaps by `seq` and fill them from the
event log, so a message lost in a reconnect costs latency, never data.

Waiting costs Redis nothing: a stream reads its log only when woken. Besides news, the router
wakes a stream without news when what it heard may be incomplete: once Redis confirms its
channel's SUBSCRIBE (a stream's first log read may have raced it), and after every reconnect
(messages sent meanwhile are lost), paced at `catchup_per_s` so thousands of streams do not
read at once.

A buffer is bounded in bytes: a stream whose client stopped reading stops taking, and past
the bound its subscription drops what it holds and stays empty until the stream takes again
("behind"), so the stream, woken without news, reads what it missed from the log — page by
page, as fast as its client reads — and the gateway's memory per stream stays bounded
whatever the job's output.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

from redis.exceptions import RedisError

from gateway.pubsub_wire import PubSubBackend

log = logging.getLogger(__name__)

ITEM_OVERHEAD_BYTES = 64
"""What a buffered message costs beyond its characters (its str header, its deque slot)."""
CATCH_UP_TICK_S = 0.01
"""The pacing of the wakes after a reconnect: each tick wakes those due by then."""
DEFAULT_CATCHUP_PER_S = 5000.0


class Subscription:
    __slots__ = (
        "_router",
        "behind",
        "buffer",
        "channel",
        "confirmed",
        "max_bytes",
        "nbytes",
        "wake",
    )

    def __init__(self, router: PubSubRouter, channel: str, max_bytes: int) -> None:
        self._router = router
        self.channel = channel
        self.max_bytes = max_bytes
        self.buffer: collections.deque[str] = collections.deque()
        self.nbytes = 0
        self.behind = False
        """The buffer overflowed since the last `take`: messages were dropped."""
        self.wake = asyncio.Event()
        """Set by news, and without news when the stream must look at its log."""
        self.confirmed = False
        """Redis confirmed the channel's SUBSCRIBE since this subscription was made."""

    def push(self, data: str) -> None:
        if not self.behind:
            size = len(data) + ITEM_OVERHEAD_BYTES
            if self.nbytes + size > self.max_bytes:
                self.buffer.clear()
                self.nbytes = 0
                self.behind = True
            else:
                self.buffer.append(data)
                self.nbytes += size
        self.wake.set()

    def take(self) -> list[str]:
        """Everything buffered (nothing if it fell behind: the log has it), and a fresh start."""
        self.wake.clear()
        items = list(self.buffer)
        self.buffer.clear()
        self.nbytes = 0
        self.behind = False
        return items

    def reading(self) -> None:
        """The stream starts reading its log: a wake without news set before now (nothing
        buffered, nothing dropped) is answered by that read."""
        if not self.buffer and not self.behind:
            self.wake.clear()

    async def close(self) -> None:
        await self._router.unsubscribe(self)


class PubSubRouter:
    """Channel bookkeeping is local and instant; SUBSCRIBE/UNSUBSCRIBE go out in batches.

    Every stream subscribing through one lock, one command at a time, turns into a convoy
    under load (each waits out the event loop for the one before it). Instead, changes
    accumulate in sets and one task sends them together; `subscribe` waits only for the
    batch that carries its channel.
    """

    def __init__(
        self,
        backend: PubSubBackend,
        *,
        buffer_bytes: int,
        catchup_per_s: float = DEFAULT_CATCHUP_PER_S,
    ) -> None:
        self._backend = backend
        self._buffer_bytes = buffer_bytes
        self._catchup_per_s = catchup_per_s
        self._subs: dict[str, set[Subscription]] = {}
        self._confirmed: set[str] = set()
        """Channels Redis confirmed subscribing (on this connection or an earlier one)."""
        self._catching_up: asyncio.Task[None] | None = None
        self._to_subscribe: set[str] = set()
        self._to_unsubscribe: set[str] = set()
        self._batch_sent: asyncio.Future[None] | None = None
        self._sender: asyncio.Task[None] | None = None

    @property
    def channels(self) -> int:
        return len(self._subs)

    async def subscribe(self, channel: str) -> Subscription:
        sub = Subscription(self, channel, self._buffer_bytes)
        sub.confirmed = channel in self._confirmed
        subs = self._subs.get(channel)
        if subs is not None:
            subs.add(sub)
            return sub
        self._subs[channel] = {sub}
        self._to_unsubscribe.discard(channel)
        if self._backend.immediate:  # a socket write: no batch, no wait for the event loop
            await self._backend.subscribe(channel)
            return sub
        self._to_subscribe.add(channel)
        await asyncio.shield(self._schedule())
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.channel)
        if subs is None:
            return
        subs.discard(sub)
        if not subs:
            del self._subs[sub.channel]
            self._confirmed.discard(sub.channel)
            self._to_subscribe.discard(sub.channel)
            if self._backend.immediate:
                await self._backend.unsubscribe(sub.channel)
                return
            self._to_unsubscribe.add(sub.channel)
            self._schedule()

    def _schedule(self) -> asyncio.Future[None]:
        """The future of the batch that will carry the pending changes."""
        if self._batch_sent is None or self._batch_sent.done():
            self._batch_sent = asyncio.get_running_loop().create_future()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_batches())
        return self._batch_sent

    async def _send_batches(self) -> None:
        while self._to_subscribe or self._to_unsubscribe:
            batch_sent = self._batch_sent
            subscribe, self._to_subscribe = self._to_subscribe, set()
            unsubscribe, self._to_unsubscribe = self._to_unsubscribe, set()
            self._batch_sent = None
            try:
                if subscribe:
                    await self._backend.subscribe(*subscribe)
                if unsubscribe:
                    await self._backend.unsubscribe(*unsubscribe)
            except (RedisError, OSError) as exc:
                # The backend reconnects and resubscribes everything it was asked for.
                log.warning("pub/sub (un)subscribe failed", extra={"error": str(exc)})
            if batch_sent is not None and not batch_sent.done():
                batch_sent.set_result(None)
        if self._batch_sent is not None and not self._batch_sent.done():
            self._batch_sent.set_result(None)

    async def run(self) -> None:
        """Receive until closed; the backend reconnects and resubscribes by itself."""
        await self._backend.run(self._dispatch, self._catch_up, self._subscribed)

    def _dispatch(self, channel: str, data: str) -> None:
        for sub in self._subs.get(channel, ()):
            sub.push(data)

    def _subscribed(self, channel: str) -> None:
        """From now on every message of `channel` arrives; a stream that read its log before
        this may have missed one published in between, so it looks again."""
        subs = self._subs.get(channel)
        if subs is None:
            return
        self._confirmed.add(channel)
        for sub in subs:
            if not sub.confirmed:
                sub.confirmed = True
                sub.wake.set()

    def _catch_up(self) -> None:
        """After a reconnect: live messages may be lost, so every stream looks at its log,
        paced (a later reconnect starts the round again, with every stream then open)."""
        self._confirmed.update(self._subs)
        subs = [sub for subs in self._subs.values() for sub in subs]
        for sub in subs:
            sub.confirmed = True
        if self._catching_up is not None:
            self._catching_up.cancel()
        self._catching_up = None
        if subs:
            self._catching_up = asyncio.create_task(self._wake_paced(subs), name="catch-up")

    async def _wake_paced(self, subs: list[Subscription]) -> None:
        start = time.monotonic()
        woken = 0
        while woken < len(subs):
            due = max(1, int((time.monotonic() - start) * self._catchup_per_s))
            for sub in subs[woken:due]:
                sub.wake.set()
            woken = max(woken, min(due, len(subs)))
            if woken < len(subs):
                await asyncio.sleep(CATCH_UP_TICK_S)
        log.info(
            "pub/sub catch-up: every stream woken",
            extra={"streams": len(subs), "seconds": round(time.monotonic() - start, 3)},
        )

    async def close(self) -> None:
        if self._catching_up is not None:
            self._catching_up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._catching_up
        await self._backend.close()
