"""The gateway's pub/sub router over genq's raw hiredis connection and over redis-py's."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.pubsub import PubSubRouter
from gateway.pubsub_wire import PubSubBackend, RawPubSub, RedisPyPubSub
from tests.conftest import REDIS_URL


@pytest.fixture(params=["raw", "redis-py"])
async def router(request: pytest.FixtureRequest, redis: aioredis.Redis):  # type: ignore[no-untyped-def]
    if request.param == "raw" and _is_fake(redis):
        pytest.skip("the raw connection needs a real Redis")
    backend: PubSubBackend = (
        RawPubSub.from_url(REDIS_URL, 5.0, f"genq-test-{uuid.uuid4().hex}")
        if request.param == "raw"
        else RedisPyPubSub(redis)
    )
    r = PubSubRouter(backend, buffer_bytes=1 << 20)
    task = asyncio.create_task(r.run())
    yield r
    await r.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _is_fake(redis: aioredis.Redis) -> bool:
    return type(redis).__module__.startswith("fakeredis")


async def _until(predicate, timeout: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_messages_reach_every_subscriber_of_a_channel(router: PubSubRouter, redis) -> None:  # type: ignore[no-untyped-def]
    ch = f"t:{uuid.uuid4().hex}"
    a = await router.subscribe(ch)
    b = await router.subscribe(ch)
    other = await router.subscribe(ch + ":other")
    await _until(lambda: True)
    async with asyncio.timeout(3):
        while not a.buffer:
            await redis.publish(ch, "m1")
            await asyncio.sleep(0.05)
    await _until(lambda: bool(b.buffer))
    assert set(a.take()) == {"m1"} and set(b.take()) == {"m1"}
    assert not other.buffer
    await a.close()
    await b.close()
    await other.close()
    assert router.channels == 0


async def test_many_concurrent_subscriptions_are_batched(router: PubSubRouter, redis) -> None:  # type: ignore[no-untyped-def]
    chans = [f"t:{uuid.uuid4().hex}" for _ in range(300)]
    subs = await asyncio.gather(*(router.subscribe(c) for c in chans))
    assert router.channels == 300
    async with asyncio.timeout(5):
        while not all(s.buffer for s in subs):
            for c, s in zip(chans, subs, strict=True):
                if not s.buffer:
                    await redis.publish(c, c)
            await asyncio.sleep(0.05)
    assert all(s.take()[0] == c for c, s in zip(chans, subs, strict=True))


async def test_a_killed_connection_reconnects_resubscribes_and_wakes_streams(
    router: PubSubRouter, redis
) -> None:  # type: ignore[no-untyped-def]
    backend = router._backend
    if not isinstance(backend, RawPubSub):
        pytest.skip("kills genq's own raw connection, found by its client name")
    ch = f"t:{uuid.uuid4().hex}"
    sub = await router.subscribe(ch)
    await _until(lambda: True)
    async with asyncio.timeout(3):
        while await redis.publish(ch, "before") == 0:
            await asyncio.sleep(0.02)
    await _until(lambda: bool(sub.buffer))
    sub.take()
    [mine] = [c for c in await redis.client_list() if c["name"] == backend.name]
    assert await redis.client_kill_filter(_id=mine["id"]) == 1
    await asyncio.wait_for(sub.wake.wait(), 5)  # woken to re-read its log
    async with asyncio.timeout(5):
        while await redis.publish(ch, "after") == 0:
            await asyncio.sleep(0.05)
    await _until(lambda: "after" in sub.buffer, timeout=5)
