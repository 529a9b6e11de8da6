"""Streams waiting for news cost Redis nothing, and still miss nothing: what a pub/sub drop
loses, a SUBSCRIBE that Redis had not confirmed when the stream first read its log, and a log
gone without a word are all noticed. Against a private redis-server, whose `INFO
commandstats` counts only these tests' commands."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis.asyncio as aioredis

from gateway.pubsub import PubSubRouter, Subscription
from gateway.pubsub_wire import OnMessage, OnSubscribed, RawPubSub, ignore_channel
from gateway.streaming import EventFollower
from shared import events
from shared.events import DoneEvent, QueuedEvent, TokenEvent
from shared.keys import Keys, event_id
from shared.redisconn import connect
from shared.schemas import Timings, Usage
from shared.settings import Settings
from tests.procs import RedisServer, redis_server

IDLE_STREAMS = 200
WATCH_S = 3.0
"""Longer than main's 2 s poll: every stream polling would show."""
KEEPALIVE_S = 0.5
QUIET_COMMANDS = 10
"""What the window may hold besides the streams: the pub/sub connection's PINGs and INFO."""
DROP_STREAMS = 50
TOKENS = 3
DELIVERY_S = 10.0


@pytest.fixture
def private() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@contextlib.asynccontextmanager
async def raw_router(url: str) -> AsyncIterator[PubSubRouter]:
    router = PubSubRouter(
        RawPubSub.from_url(url, 5.0, f"genq-idle-{uuid.uuid4().hex}"), buffer_bytes=1 << 20
    )
    task = asyncio.create_task(router.run())
    try:
        yield router
    finally:
        await router.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _queued(job_id: str) -> str:
    return events.encode(
        QueuedEvent(seq=1, id=job_id, model="m", priority="interactive", prompt_tokens=1)
    )


def _rest(job_id: str) -> list[str]:
    """Events 2.. of a job: TOKENS tokens, then done."""
    out = [
        events.encode(TokenEvent(seq=s, text=f" {job_id[:4]}{s}", token_ids=[s], count=1))
        for s in range(2, TOKENS + 2)
    ]
    done = DoneEvent(seq=TOKENS + 2, finish_reason="length", usage=Usage(), timings=Timings())
    return [*out, events.encode(done)]


def _write(pipe: aioredis.client.Pipeline, keys: Keys, job_id: str, seq: int, data: str) -> None:
    """As the Lua scripts do: log it, then publish it."""
    pipe.xadd(keys.events(job_id), {"d": data}, id=event_id(seq))
    pipe.publish(keys.channel(job_id), data)


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


class Reader:
    """One stream's consumer: what it got, in order, and its keepalives."""

    def __init__(self, follower: EventFollower) -> None:
        self.follower = follower
        self.got: list[tuple[int, str]] = []
        self.keepalives = 0
        self.ended = False
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for batch in self.follower.batches():
            if batch is None:
                self.keepalives += 1
            else:
                self.got += [(seq, etype) for seq, etype, _ in batch]
        self.ended = True


async def _subscribed(admin: aioredis.Redis, channels: list[str]) -> None:
    """Until Redis has every channel subscribed (and then a moment, for the checks that
    the streams make once their SUBSCRIBE is confirmed)."""
    async with asyncio.timeout(DELIVERY_S):
        while not all(n for _, n in await admin.pubsub_numsub(*channels)):
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)


async def _commands(admin: aioredis.Redis) -> dict[str, int]:
    stats = await admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def test_idle_streams_issue_no_redis_commands_and_still_send_keepalives(
    private: RedisServer,
) -> None:
    settings = Settings(redis_url=private.url, key_prefix="idle:", sse_keepalive_s=KEEPALIVE_S)
    keys = Keys(settings.key_prefix)
    admin = connect(settings)  # the gateway's client: a blocking pool
    jobs = [uuid.uuid4().hex for _ in range(IDLE_STREAMS)]
    pipe = admin.pipeline(transaction=False)
    for job_id in jobs:
        _write(pipe, keys, job_id, 1, _queued(job_id))
    await pipe.execute()
    async with raw_router(private.url) as router:
        subs = [await router.subscribe(keys.channel(j)) for j in jobs]
        readers = [
            Reader(EventFollower(admin, keys, settings, sub, j))
            for sub, j in zip(subs, jobs, strict=True)
        ]
        await _until(lambda: all(r.got for r in readers), DELIVERY_S, "every log replayed")
        await _subscribed(admin, [keys.channel(j) for j in jobs])
        before = await _commands(admin)
        await asyncio.sleep(WATCH_S)
        after = await _commands(admin)
        try:
            reads = {c: after.get(c, 0) - before.get(c, 0) for c in ("xrange", "xrevrange")}
            assert reads == {"xrange": 0, "xrevrange": 0}
            total = sum(after.values()) - sum(before.values())
            assert total <= QUIET_COMMANDS, (total, after)
            assert all(r.keepalives >= WATCH_S // KEEPALIVE_S - 1 for r in readers)
            assert not any(r.ended for r in readers)
        finally:
            for r in readers:
                r.task.cancel()
            await asyncio.gather(*(r.task for r in readers), return_exceptions=True)
            for sub in subs:
                await sub.close()
    await admin.aclose()


async def test_events_published_while_pubsub_is_down_arrive_once_each_in_order(
    private: RedisServer,
) -> None:
    """The kill and the writes run in one MULTI: every PUBLISH meets no subscriber (lost), and
    only the catch-up after the reconnect can deliver them. Half the jobs get their ending
    during the drop; the other half get it live, after the reconnect."""
    settings = Settings(redis_url=private.url, key_prefix="drop:", stream_catchup_per_s=100.0)
    keys = Keys(settings.key_prefix)
    admin = connect(settings)  # the gateway's client: a blocking pool
    jobs = [uuid.uuid4().hex for _ in range(DROP_STREAMS)]
    pipe = admin.pipeline(transaction=False)
    for job_id in jobs:
        _write(pipe, keys, job_id, 1, _queued(job_id))
    await pipe.execute()
    async with raw_router(private.url) as router:
        readers = [
            Reader(EventFollower(admin, keys, settings, await router.subscribe(keys.channel(j)), j))
            for j in jobs
        ]
        await _until(lambda: all(r.got for r in readers), DELIVERY_S, "every log replayed")
        await _subscribed(admin, [keys.channel(j) for j in jobs])
        half = len(jobs) // 2
        drop = admin.pipeline(transaction=True)
        drop.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        for job_id in jobs:
            rest = _rest(job_id)
            cut = len(rest) if job_id in jobs[:half] else 1
            for seq, data in enumerate(rest[:cut], start=2):
                _write(drop, keys, job_id, seq, data)
        killed, *replies = await drop.execute()
        assert killed == 1
        assert not any(replies[1::2]), "a PUBLISH during the drop reached a subscriber"
        await _until(lambda: all(r.ended for r in readers[:half]), DELIVERY_S, "caught up")
        await _until(lambda: all(r.got[-1][0] == 2 for r in readers[half:]), DELIVERY_S, "seq 2")
        pipe = admin.pipeline(transaction=False)
        for job_id in jobs[half:]:
            for seq, data in enumerate(_rest(job_id)[1:], start=3):
                _write(pipe, keys, job_id, seq, data)
        await pipe.execute()
        await _until(lambda: all(r.ended for r in readers), DELIVERY_S, "every stream ended")
    expected = [(1, "queued"), *((s, "token") for s in range(2, TOKENS + 2)), (TOKENS + 2, "done")]
    assert all(r.got == expected for r in readers), [r.got for r in readers if r.got != expected]
    assert all(r.follower.finished for r in readers)
    await admin.aclose()


class Unconfirmed:
    """A pub/sub backend whose SUBSCRIBEs Redis has not confirmed yet: the test confirms."""

    immediate = True

    def __init__(self) -> None:
        self.confirm: OnSubscribed = ignore_channel

    async def run(
        self,
        on_message: OnMessage,
        on_reconnect: Callable[[], None],
        on_subscribed: OnSubscribed = ignore_channel,
    ) -> None:
        self.confirm = on_subscribed
        await asyncio.Event().wait()

    async def subscribe(self, *channels: str) -> None:
        pass

    async def unsubscribe(self, *channels: str) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_an_ending_published_before_redis_confirmed_the_subscribe_is_read_from_the_log(
    private: RedisServer,
) -> None:
    """The stream read its log; the job ended before its SUBSCRIBE took effect (two connections:
    Redis may run the read first), so the `done` went to nobody. The confirmation makes the
    stream look at its log again."""
    settings = Settings(redis_url=private.url, key_prefix="confirm:")
    keys = Keys(settings.key_prefix)
    admin = connect(settings)  # the gateway's client: a blocking pool
    job_id = uuid.uuid4().hex
    pipe = admin.pipeline(transaction=False)
    _write(pipe, keys, job_id, 1, _queued(job_id))
    await pipe.execute()
    backend = Unconfirmed()
    router = PubSubRouter(backend, buffer_bytes=1 << 20)
    task = asyncio.create_task(router.run())
    sub = await router.subscribe(keys.channel(job_id))
    reader = Reader(EventFollower(admin, keys, settings, sub, job_id))
    await _until(lambda: reader.got == [(1, "queued")], DELIVERY_S, "the log replayed")
    pipe = admin.pipeline(transaction=False)
    for seq, data in enumerate(_rest(job_id), start=2):
        _write(pipe, keys, job_id, seq, data)
    await pipe.execute()
    await asyncio.sleep(0.2)
    assert not reader.ended  # nothing told it
    backend.confirm(keys.channel(job_id))
    await _until(lambda: reader.ended, DELIVERY_S, "the stream ended")
    assert [s for s, _ in reader.got] == list(range(1, TOKENS + 3)) and reader.follower.finished
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await admin.aclose()


async def test_a_stream_whose_log_vanished_unannounced_ends_at_its_safety_check(
    private: RedisServer,
) -> None:
    """A log evicted (or lost) says nothing on the channel: the slow safety read notices."""
    poll_s = 0.3
    settings = Settings(redis_url=private.url, key_prefix="gone:", stream_idle_poll_s=poll_s)
    keys = Keys(settings.key_prefix)
    admin = connect(settings)  # the gateway's client: a blocking pool
    job_id = uuid.uuid4().hex
    pipe = admin.pipeline(transaction=False)
    _write(pipe, keys, job_id, 1, _queued(job_id))
    await pipe.execute()
    async with raw_router(private.url) as router:
        sub = await router.subscribe(keys.channel(job_id))
        reader = Reader(EventFollower(admin, keys, settings, sub, job_id))
        await _until(lambda: reader.got == [(1, "queued")], DELIVERY_S, "the log replayed")
        await admin.delete(keys.events(job_id))
        start = time.monotonic()
        await _until(lambda: reader.ended, DELIVERY_S, "the stream ended")
        assert time.monotonic() - start <= poll_s * 1.5 + 1.0
        await sub.close()
    await admin.aclose()


async def test_a_reconnect_wakes_every_stream_paced_not_at_once() -> None:
    router = PubSubRouter(Unconfirmed(), buffer_bytes=1 << 20, catchup_per_s=10_000)
    subs: list[Subscription] = [await router.subscribe(f"ch{i}") for i in range(2000)]
    start = time.monotonic()
    router._catch_up()  # what a reconnect runs
    assert sum(s.wake.is_set() for s in subs) < len(subs) // 2
    await _until(lambda: all(s.wake.is_set() for s in subs), 5.0, "every stream woken")
    assert time.monotonic() - start >= 0.1  # 2,000 at 10,000/s: 0.2 s
