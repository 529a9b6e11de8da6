"""Gateways create the queues' consumer groups (gateway/queues.py), so that a queue autoscaler
(KEDA) finds them with no worker running: at start, for GENQ_QUEUE_MODELS and every model a
worker ever announced."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.queues import RETRY_S, QueueGroups
from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys
from tests.conftest import REDIS_URL, test_prefix
from tests.procs import Cluster, RedisServer, free_port, wait_for

pytestmark = pytest.mark.e2e
GATEWAY_START_S = 20.0


@pytest.fixture
def prefix() -> Iterator[str]:
    p = test_prefix()
    yield p
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    for key in r.scan_iter(match=f"{p}*", count=1000):
        r.delete(key)
    r.close()


def _groups(r: redis.Redis, stream: str) -> list[dict]:
    try:
        return list(r.xinfo_groups(stream))
    except ResponseError:  # no such key
        return []


def test_gateway_start_creates_the_groups_before_any_worker(tmp_path: Path, prefix: str) -> None:
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = Keys(prefix)
    r.sadd(keys.models(), "announced")  # as a worker that ran once leaves it
    cluster = Cluster(REDIS_URL, tmp_path, prefix, GENQ_QUEUE_MODELS='["configured"]')
    try:
        cluster.gateway()  # ready: its lifespan has run
        for model in ("configured", "announced"):
            for p in PRIORITIES:
                (group,) = _groups(r, keys.queue(model, p))
                # what KEDA's lagCount / pendingEntriesCount triggers read: an empty group
                assert (group["name"], group["lag"], group["pending"]) == (CONSUMER_GROUP, 0, 0)
        assert r.zcard(keys.workers()) == 0, "a worker ran"
        assert _groups(r, keys.queue("unknown", "interactive")) == []
    finally:
        cluster.close()
        r.close()


def test_gateway_started_while_redis_is_away_creates_them_once_it_answers(
    tmp_path: Path, prefix: str
) -> None:
    server = RedisServer(tmp_path)
    cluster = Cluster(server.url, tmp_path, prefix, GENQ_QUEUE_MODELS='["m"]')
    port = free_port()
    try:
        gw = cluster._spawn("gateway", ["gateway", "--port", str(port)], port)
        wait_for(
            lambda: httpx.get(f"{gw.url}/healthz", timeout=1).status_code == 200,
            timeout=GATEWAY_START_S,
            what=f"gateway up without Redis: {gw.output()[-500:]}",
        )
        server.start()
        r = redis.Redis.from_url(server.url, decode_responses=True)
        wait_for(
            lambda: all(_groups(r, Keys(prefix).queue("m", p)) for p in PRIORITIES),
            timeout=RETRY_S + 10,
            what="groups created after Redis came back",
        )
        r.close()
    finally:
        cluster.close()
        server.kill()


@pytest.fixture
async def aio(prefix: str) -> AsyncIterator[tuple[aioredis.Redis, Keys]]:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client, Keys(prefix)
    await client.aclose()


async def test_an_existing_group_keeps_its_state(aio: tuple[aioredis.Redis, Keys]) -> None:
    r, keys = aio
    queue = keys.queue("m", "interactive")
    await r.xgroup_create(queue, CONSUMER_GROUP, id="0", mkstream=True)
    await r.xadd(queue, {"job": "a"})
    await r.xadd(queue, {"job": "b"})
    await r.xreadgroup(CONSUMER_GROUP, "w1", {queue: ">"}, count=1)
    await QueueGroups(r, keys, ["m"]).sync()
    (group,) = await r.xinfo_groups(queue)
    assert (group["pending"], group["lag"]) == (1, 1)


async def test_a_group_starts_at_the_first_job_queued(aio: tuple[aioredis.Redis, Keys]) -> None:
    """Jobs queued before the group existed are not skipped: workers and KEDA see them."""
    r, keys = aio
    queue = keys.queue("m", "batch")
    for job in ("a", "b", "c"):
        await r.xadd(queue, {"job": job})
    await QueueGroups(r, keys, ["m"]).sync()
    (group,) = await r.xinfo_groups(queue)
    assert group["lag"] == 3
    claimed = await r.xreadgroup(CONSUMER_GROUP, "w1", {queue: ">"}, count=10)
    assert [f["job"] for _, f in claimed[0][1]] == ["a", "b", "c"]


async def test_a_lost_group_is_created_again(aio: tuple[aioredis.Redis, Keys]) -> None:
    r, keys = aio
    groups = QueueGroups(r, keys, [])
    await r.sadd(keys.models(), "m")
    await groups.sync()
    await r.delete(keys.queue("m", "interactive"))  # e.g. a Redis restarted without its data
    await groups.sync()
    for p in PRIORITIES:
        assert [g["name"] for g in await r.xinfo_groups(keys.queue("m", p))] == [CONSUMER_GROUP]


async def test_a_key_of_another_type_is_left_alone(aio: tuple[aioredis.Redis, Keys]) -> None:
    r, keys = aio
    await r.set(keys.queue("m", "interactive"), "not a stream")
    await QueueGroups(r, keys, ["m"]).sync()  # logged, not raised: the other queue still done
    assert await r.get(keys.queue("m", "interactive")) == "not a stream"
    assert await r.xinfo_groups(keys.queue("m", "batch"))
