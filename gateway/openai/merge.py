"""Following a request's jobs: their events merged into one stream, helper tasks stopped for
sure, and a client's disconnect noticed while nothing is being sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
from fastapi import Request

from gateway.streaming import EventFollower

Batch = list[tuple[int, str, str]]
CANCEL_RETRY_S = 0.05
"""How long a cancelled helper task gets to end before it is cancelled again."""


async def merged(
    followers: list[EventFollower],
) -> AsyncIterator[tuple[int, Batch | None]]:
    """Every follower's batches as they come, tagged with its index; None = keepalive.

    The queue holds at most one batch per follower: while the consumer (a client) does not
    take, the followers stop reading, and their subscriptions fall behind instead of the
    gateway buffering the jobs' output.
    """
    queue: asyncio.Queue[tuple[int, Batch | BaseException | None, bool]] = asyncio.Queue(
        maxsize=len(followers)
    )

    async def pump(index: int, follower: EventFollower) -> None:
        try:
            async for batch in follower.batches():
                await queue.put((index, batch, False))
        except Exception as exc:
            await queue.put((index, exc, True))
        else:
            await queue.put((index, None, True))

    tasks = [asyncio.create_task(pump(i, f)) for i, f in enumerate(followers)]
    live = len(tasks)
    try:
        while live:
            index, item, ended = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if ended:
                live -= 1
            else:
                yield index, item
    finally:
        with anyio.CancelScope(shield=True):
            await stop_tasks(tasks)


async def stop_tasks(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait for them, cancelling again while one lives on.

    A follower parked in a Redis call can absorb a single cancel (it may surface as a
    RedisError, which the follower treats as a blip) and wait on; anyio re-delivers
    cancellation for the same reason.
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_RETRY_S)


async def disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
