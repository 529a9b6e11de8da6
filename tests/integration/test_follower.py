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


async def test_a_live_stream_whose_log_was_rewritten_by_a_new_attempt_ends_diverged(
    redis: aioredis.Redis, settings: Settings
) -> None:
    """Redis lost events 6..10 a live client had seen (attempt 1), their writer is gone, and
    attempt 2 began at seq 6: its token at 11 would not continue what the client has."""
    keys = Keys(settings.key_prefix)
    job_id = uuid.uuid4().hex
    key = keys.events(job_id)
    first = [
        events.encode(QueuedEvent(seq=1, id=job_id, model="m", priority="batch", prompt_tokens=1))
    ]
    first.append(events.encode(events.StartedEvent(seq=2, attempt=1, worker="w1")))
    first += [
        events.encode(TokenEvent(seq=s, attempt=1, text=f" a{s}", token_ids=[s], count=1))
        for s in range(3, 11)
    ]
    for seq, data in enumerate(first, start=1):
        await redis.xadd(key, {"d": data}, id=event_id(seq))
    router = PubSubRouter(RedisPyPubSub(redis), buffer_bytes=BUFFER_BYTES)
    sub = await router.subscribe(keys.channel(job_id))
    follower = EventFollower(redis, keys, settings, sub, job_id)
    stream = follower.batches()
    try:
        seen = await anext(stream)
        assert seen is not None and [s for s, _, _ in seen] == list(range(1, 11))
        await redis.delete(key)  # Redis restarted without its last writes: 6..10 are gone
        for seq, data in enumerate(first[:5], start=1):
            await redis.xadd(key, {"d": data}, id=event_id(seq))
        rerun = [
            events.encode(events.StartedEvent(seq=6, attempt=2, worker="w2", resumed_tokens=4))
        ]
        rerun += [
            events.encode(TokenEvent(seq=s, attempt=2, text=f" b{s}", token_ids=[s], count=1))
            for s in range(7, 13)
        ]
        for seq, data in enumerate(rerun, start=6):
            await redis.xadd(key, {"d": data}, id=event_id(seq))
        for data in rerun:
            sub.push(data)
        after: list[tuple[int, str, str]] = []
        async for batch in stream:
            after += batch or []
        assert [(seq, etype) for seq, etype, _ in after] == [(0, "error")]
        assert events.decode(after[0][2]).code == "stream_diverged"  # type: ignore[union-attr]
        assert follower.finished and follower.diverged
    finally:
        await sub.close()
        await redis.delete(key)
