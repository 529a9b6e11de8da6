"""OpenAI's list pages over a sorted-set index (id scored by creation time): `after` is the
last id of the previous page. Ids whose record has expired leave the index as they are met."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis

from shared.batches import ObjectList

T = TypeVar("T")
_SCAN = 100
"""Index entries read per round while filling a page."""


async def page(
    redis: aioredis.Redis,
    index: str,
    load: Callable[[Sequence[str]], Awaitable[list[T | None]]],
    view: Callable[[T], Any],
    *,
    after: str | None,
    limit: int,
    newest_first: bool = True,
    keep: Callable[[T], bool] = lambda _: True,
) -> ObjectList:
    """Up to `limit` objects after `after`, in creation order (newest first by default)."""
    start = 0
    if after is not None:
        rank = await (redis.zrevrank(index, after) if newest_first else redis.zrank(index, after))
        if rank is None or not await _visible(after, load, keep):
            # expired, never was, or another owner's (nothing may tell those apart): nothing
            # is known to follow it
            return ObjectList(data=[], first_id=None, last_id=None, has_more=False)
        start = rank + 1
    items: list[Any] = []
    has_more = False
    while len(items) <= limit:
        ids = await (redis.zrevrange if newest_first else redis.zrange)(
            index, start, start + _SCAN - 1
        )
        if not ids:
            break
        start += len(ids)
        gone = []
        for object_id, obj in zip(ids, await load(ids), strict=True):
            if obj is None:
                gone.append(object_id)
            elif keep(obj):
                if len(items) == limit:
                    has_more = True
                    break
                items.append(view(obj))
        if gone:
            await redis.zrem(index, *gone)
            start -= len(gone)
        if has_more:
            break
    return ObjectList(
        data=items,
        first_id=items[0].id if items else None,
        last_id=items[-1].id if items else None,
        has_more=has_more,
    )


async def _visible(
    object_id: str,
    load: Callable[[Sequence[str]], Awaitable[list[T | None]]],
    keep: Callable[[T], bool],
) -> bool:
    """Whether a page may start after this id: not another owner's (one whose record just
    expired still may: its place in the index is all that is used)."""
    [obj] = await load([object_id])
    return obj is None or keep(obj)
