"""A stream's live buffer is bounded in bytes; a stream that falls behind reads what it missed
from the job's log in pages about the buffer's size, and loses nothing. On real Redis and on
fakeredis."""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

from gateway.pubsub import ITEM_OVERHEAD_BYTES, PubSubRouter, Subscription
from gateway.pubsub_wire import RedisPyPubSub
from gateway.streaming import EventFollower
from shared import events
from shared.events import DoneEvent, QueuedEvent, TokenEvent
from shared.keys import Keys, event_id
from shared.schemas import Timings, Usage
from shared.settings import Settings

BUFFER_BYTES = 4096
TOKENS = 400
PAGE_ENTRIES = 16


def _job_log(job_id: str) -> list[str]:
    """A finished job's events, encoded: queued, TOKENS tokens, done."""
    out = [
        events.encode(QueuedEvent(seq=1, id=job_id, model="m", priority="batch", prompt_tokens=1))
    ]
    for seq in range(2, TOKENS + 2):
        out.append(events.encode(TokenEvent(seq=seq, text=f" w{seq}", token_ids=[seq], count=1)))
    done = DoneEvent(seq=TOKENS + 2, finish_reason="length", usage=Usage(), timings=Timings())
    return [*out, events.encode(done)]


def test_a_subscription_past_its_bound_drops_what_it_holds_until_taken() -> None:
    router = PubSubRouter(RedisPyPubSub(aioredis.Redis()), buffer_bytes=BUFFER_BYTES)
    sub = Subscription(router, "ch", BUFFER_BYTES)
    message = "x" * 1000
    fits = BUFFER_BYTES // (len(message) + ITEM_OVERHEAD_BYTES)
    for _ in range(fits):
        sub.push(message)
    assert len(sub.buffer) == fits and not sub.behind
    sub.push(message)
    assert sub.behind and not sub.buffer and sub.nbytes == 0 and sub.wake.is_set()
    sub.push(message)  # behind: dropped until the stream takes (and reads the log)
    assert not sub.buffer
    assert sub.take() == [] and not sub.behind and not sub.wake.is_set()
    sub.push(message)
    assert sub.take() == [message]


async def test_a_stream_that_fell_behind_reads_the_log_in_bounded_pages_and_loses_nothing(
    redis: aioredis.Redis, settings: Settings
) -> None:
    settings.stream_buffer_bytes = BUFFER_BYTES
    settings.event_page_entries = PAGE_ENTRIES
    keys = Keys(settings.key_prefix)
    job_id = uuid.uuid4().hex
    log = _job_log(job_id)
    for seq, data in enumerate(log, start=1):
        await redis.xadd(keys.events(job_id), {"d": data}, id=event_id(seq))
    router = PubSubRouter(RedisPyPubSub(redis), buffer_bytes=BUFFER_BYTES)
    sub = Subscription(router, keys.channel(job_id), BUFFER_BYTES)
    for data in log:  # all of it went by live while the client was not reading
        sub.push(data)
    assert sub.behind
    follower = EventFollower(redis, keys, settings, sub, job_id)
    try:
        batches = [b async for b in follower.batches() if b is not None]
    finally:
        await redis.delete(keys.events(job_id))
    assert [data for b in batches for _, _, data in b] == log
    assert follower.finished
    assert max(len(b) for b in batches) <= PAGE_ENTRIES
    assert max(sum(len(d) for _, _, d in b) for b in batches) <= BUFFER_BYTES
