"""A job's events as SSE: replay the log, then follow live, filling any gap from the log.

Frames: `id: <seq>`, `event: <type>`, `data: <event JSON>`; the JSON passes through as the
worker wrote it. Everything buffered when the stream wakes goes out as one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.pubsub import Subscription
from shared import events
from shared.events import EVENT_FIELD, FINAL_EVENT_TYPES
from shared.keys import Keys, event_id, seq_of
from shared.settings import GatewaySettings

KEEPALIVE = b": keepalive\n\n"


class EventFollower:
    """Yields a job's events (seq, type, JSON) in order, exactly once each, then stops."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: GatewaySettings,
        sub: Subscription,
        job_id: str,
        after_seq: int = 0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.sub = sub
        self.job_id = job_id
        self.last = after_seq
        self.finished = False

    async def read_log(self) -> list[tuple[int, str, str]]:
        """Events after `last` from the job's log."""
        entries = await self.redis.xrange(self.keys.events(self.job_id), f"({event_id(self.last)}")
        return self._accept([_from_log(i, f[EVENT_FIELD]) for i, f in entries])

    def _accept(self, items: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
        """The run of items that continues `last` without a hole."""
        out = []
        for seq, etype, data in items:
            if seq != self.last + 1:
                break
            out.append((seq, etype, data))
            self.last = seq
            if etype in FINAL_EVENT_TYPES:
                self.finished = True
                break
        return out

    async def batches(self) -> AsyncIterator[list[tuple[int, str, str]] | None]:
        """Batches of new events; None after `sse_keepalive_s` without any."""
        backlog = await self._refill()  # Redis away: the loop below keeps re-reading
        if backlog:
            yield backlog
        idle_since = time.monotonic()
        while not self.finished:
            if not self.sub.buffer:
                try:
                    async with asyncio.timeout(self.settings.stream_idle_poll_s):
                        await self.sub.wake.wait()
                except TimeoutError:
                    pass
            taken = self.sub.take()
            live = [e for e in map(_parse, taken) if e[0] > self.last]
            if live and live[0][0] == self.last + 1:
                batch = self._accept(live)
                if self.last < live[-1][0] and not self.finished:
                    batch += await self._refill()  # a hole inside the burst
            elif live or not taken:  # a hole, or woken without news: the log has the truth
                batch = await self._refill()
            else:
                batch = []
            if batch:
                idle_since = time.monotonic()
                yield batch
            elif time.monotonic() - idle_since >= self.settings.sse_keepalive_s:
                idle_since = time.monotonic()
                yield None
            if not batch and not self.finished and not await self._job_exists():
                return

    async def _refill(self) -> list[tuple[int, str, str]]:
        try:
            return await self.read_log()
        except (RedisError, OSError):
            return []

    async def _job_exists(self) -> bool:
        try:
            return bool(await self.redis.exists(self.keys.events(self.job_id)))
        except (RedisError, OSError):
            return True  # Redis is away: keep waiting for it


def sse_frame(seq: int, etype: str, data: str) -> str:
    return f"id: {seq}\nevent: {etype}\ndata: {data}\n\n"


async def sse_stream(follower: EventFollower) -> AsyncIterator[bytes]:
    async for batch in follower.batches():
        if batch is None:
            yield KEEPALIVE
        else:
            yield "".join(sse_frame(*e) for e in batch).encode()


def _from_log(entry_id: str, data: str) -> tuple[int, str, str]:
    return seq_of(entry_id), events.peek(data)[1], data


def _parse(data: str) -> tuple[int, str, str]:
    seq, etype = events.peek(data)
    return seq, etype, data


class EventStreamResponse(StreamingResponse):
    """SSE response that notices a client's disconnect at once, even on an idle stream.

    Starlette only races the body against `http.disconnect` for older ASGI spec versions; a
    stream that must cancel its job within a second cannot wait for its next write to fail.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], job_id: str | None = None) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if job_id:
            headers["X-Job-Id"] = job_id
        super().__init__(content, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def body() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(body)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
