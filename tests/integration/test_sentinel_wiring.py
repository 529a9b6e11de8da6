"""The pieces Sentinel failover rests on, against real redis-servers: the raw pub/sub
connection asks where the master is before every connection and subscribes again there, and
a submit's WAIT runs on the connection that wrote (issue 16; the whole failover:
tests/chaos/test_sentinel_failover.py)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import cast

import pytest
import redis.asyncio as aioredis
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel

from gateway.pubsub_wire import RawPubSub, SentinelMaster
from shared.keys import Keys
from shared.transitions import Call, Script, ScriptRunner
from tests.conftest import REDIS_URL, test_prefix
from tests.integration.test_pubsub_wire import (
    CONNECT_TIMEOUT_S,
    Receiver,
    private_redis,
    published_and_heard,
    until,
)

pytestmark = pytest.mark.contract  # redis-py's Sentinel and connection internals

WAIT_TIMEOUT_MS = 50


@dataclass
class FakeSentinels:
    """What `SentinelMaster` asks of redis-py's Sentinel; the test says where the master is."""

    port: int | None
    asked: int = 0
    closed: bool = False

    async def discover_master(self, name: str) -> tuple[str, int]:
        self.asked += 1
        if self.port is None:
            raise MasterNotFoundError(f"No master found for {name!r}")
        return "127.0.0.1", self.port

    async def aclose(self) -> None:
        self.closed = True


async def test_raw_pubsub_follows_the_master_the_sentinels_name() -> None:
    with private_redis() as old, private_redis() as new:
        sentinels = FakeSentinels(old.port)
        target = SentinelMaster.of(cast(Sentinel, sentinels), "genq", CONNECT_TIMEOUT_S, None, None)
        backend = RawPubSub(target, f"genq-wire-{uuid.uuid4().hex}")
        rx = Receiver(backend)
        task = asyncio.create_task(backend.run(rx.on_message, rx.on_ready))
        old_admin = aioredis.Redis(port=old.port, decode_responses=True)
        new_admin = aioredis.Redis(port=new.port, decode_responses=True)
        try:
            await backend.subscribe("wire:failover")
            await published_and_heard(old_admin, rx, "wire:failover")
            assert "sentinel master genq" in target.where and str(old.port) in target.where
            sentinels.port = None  # mid-election: no sentinel names a master yet
            old.kill()
            await until(lambda: sentinels.asked >= 3, 10, "the sentinels asked again, retried")
            sentinels.port = new.port  # promoted
            readies = rx.readies
            await until(lambda: rx.readies > readies, 10, "subscribed at the new master")
            await published_and_heard(new_admin, rx, "wire:failover")
        finally:
            await backend.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await new_admin.aclose()
            await old_admin.aclose()
            await target.aclose()
        assert sentinels.closed


SET_AND_ECHO = Script("set_and_echo", "redis.call('SET', KEYS[1], ARGV[1]) return ARGV[1]")


async def test_wait_counts_replicas_of_this_write_and_the_write_stands_without_them() -> None:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    key = Keys(test_prefix()).job(uuid.uuid4().hex)
    call: Call[str] = Call(SET_AND_ECHO, [key], ["v1"], str)
    try:
        runner = ScriptRunner(client)
        # The test Redis has no replica: WAIT gives up after its timeout, the write stands.
        assert await runner.run_replicated(call, 1, WAIT_TIMEOUT_MS) == ("v1", 0)
        assert await client.get(key) == "v1"
        assert await runner.run_replicated(call, 0, WAIT_TIMEOUT_MS) == ("v1", 0)
    finally:
        await client.delete(key)
        await client.aclose()


async def test_wait_on_a_replica_pair_returns_once_the_replica_has_the_write() -> None:
    with private_redis() as master, private_redis() as replica:
        admin = aioredis.Redis(port=replica.port, decode_responses=True)
        await admin.replicaof("127.0.0.1", master.port)
        client = aioredis.Redis(port=master.port, decode_responses=True)
        try:

            async def linked() -> bool:
                return (await admin.info("replication"))["master_link_status"] == "up"

            async with asyncio.timeout(20):
                while not await linked():
                    await asyncio.sleep(0.05)
            call: Call[str] = Call(SET_AND_ECHO, ["k"], ["v2"], str)
            assert await ScriptRunner(client).run_replicated(call, 1, 5000) == ("v2", 1)
            assert await admin.get("k") == "v2"  # held by the replica when the reply came
        finally:
            await client.aclose()
            await admin.aclose()
