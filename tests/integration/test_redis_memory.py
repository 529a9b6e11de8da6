"""A full Redis is not an outage (issue 12, item 6; issue 13, item 3): on a real redis-server
at its maxmemory (noeviction) errors say "Redis is out of memory" and /readyz answers 503
saying so; before that, above GENQ_REDIS_MEMORY_LIMIT, the gateway refuses new jobs itself
(503 + Retry-After) while Redis still takes writes, and reads go on."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from shared.settings import Settings
from tests.conftest import gateway_only
from tests.procs import RedisServer, redis_server

JOB = {"model": "sim", "prompt": "x", "max_tokens": 4}
FULL_MAXMEMORY = 1
"""Bytes: far below anything Redis uses, so every write is refused (maxmemory 1 KiB below its
use was not always: freed client buffers took it back under, and a probe went through)."""
NEARLY_FULL = 0.95
"""Of maxmemory, above the gateway's limit (0.9) with room left for Redis's own writes."""
BALLAST_BYTES = 16 * 2**20
WAIT_S = 10.0
POLL_S = 0.02


@pytest.fixture
async def server() -> AsyncIterator[tuple[RedisServer, aioredis.Redis]]:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    with redis_server() as srv:
        client = aioredis.Redis.from_url(srv.url, decode_responses=True)
        try:
            yield srv, client
        finally:
            await client.config_set("maxmemory", 0)
            await client.aclose()


async def _set_maxmemory(client: aioredis.Redis, fraction_used: float | None) -> None:
    """maxmemory so that Redis uses `fraction_used` of it (None: past it, writes refused)."""
    if fraction_used is None:
        await client.config_set("maxmemory", FULL_MAXMEMORY)
        return
    used = int((await client.info("memory"))["used_memory"])
    await client.config_set("maxmemory", int(used / fraction_used))


async def test_a_full_redis_is_named_in_errors_and_in_readiness(
    settings: Settings, server: tuple[RedisServer, aioredis.Redis]
) -> None:
    srv, client = server
    # the gateway's own check off: Redis itself refuses
    s = Settings(**{**settings.model_dump(), "redis_url": srv.url, "redis_memory_limit": 0})
    async with gateway_only(s, client) as c:
        earlier = (await c.post("/v1/jobs", json=JOB)).json()["id"]
        assert (await c.get("/readyz")).json()["redis_memory"]["writes"] == "ok"
        await _set_maxmemory(client, None)
        refused = await c.post("/v1/jobs", json=JOB)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "redis_out_of_memory"
        assert "Redis is out of memory" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        ready = await c.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["status"] == "redis out of memory"
        assert ready.json()["redis_memory"]["writes"] == "refused: out of memory"
        assert (await c.get(f"/v1/jobs/{earlier}")).json()["status"] == "queued"  # reads go on
        await client.config_set("maxmemory", 0)
        assert (await c.get("/readyz")).status_code == 200
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 202


async def test_a_nearly_full_redis_refuses_new_jobs_before_redis_does(
    settings: Settings, server: tuple[RedisServer, aioredis.Redis]
) -> None:
    srv, client = server
    quick = {"redis_url": srv.url, "redis_memory_check_s": POLL_S}
    s = Settings(**{**settings.model_dump(), **quick})
    # ballast: 5 % of what Redis then uses is room enough for the jobs and connection
    # buffers that come and go while the test runs (of a bare server's ~1 MB it was not)
    await client.set("ballast", "x" * BALLAST_BYTES)
    async with gateway_only(s, client) as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 202
        # maxmemory is made anew each round: Redis's use moves with connection buffers and
        # the gateway's loops, and once set it fell under the limit (a CI run waited 10 s)
        async with asyncio.timeout(WAIT_S):  # this process's reading is renewed
            while True:
                await _set_maxmemory(client, NEARLY_FULL)
                refused = await c.post("/v1/jobs", json=JOB)
                if refused.status_code != 202:
                    break
                await asyncio.sleep(POLL_S)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "redis_memory_full"
        assert "Redis is nearly out of memory" in error["message"]
        assert "GENQ_REDIS_MEMORY_LIMIT" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        # The jobs admitted until this process's reading caught up (and new connections'
        # buffers) can take Redis to its maxmemory on a slow host, and /readyz rightly says
        # it is out of memory: room again, still above the gateway's limit.
        await _set_maxmemory(client, NEARLY_FULL)
        ready = await c.get("/readyz")
        assert ready.status_code == 200, ready.text  # Redis takes writes: reads, cancels, ends
        memory = ready.json()["redis_memory"]
        assert memory["writes"] == "ok" and memory["admitting"] is False
        assert memory["used_fraction"] >= 0.9
        await client.config_set("maxmemory", 0)
        async with asyncio.timeout(WAIT_S):
            while (await c.post("/v1/jobs", json=JOB)).status_code != 202:
                await asyncio.sleep(POLL_S)
