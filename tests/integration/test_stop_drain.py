"""A worker's stop (worker/drain.py) waits only for the running jobs someone waits on (a
subscriber on the job's channel: an open stream); the others go back to the queue at once, so
a job nobody follows, carried over from an earlier stop, never holds the next one. Every job a
stop hands back counts an interruption; one interrupted more than GENQ_MAX_INTERRUPTIONS
times fails with an error saying so instead of carrying over from stop to stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import redis.asyncio as aioredis

from gateway.app import create_app
from shared.keys import Keys
from shared.settings import Settings
from tests.conftest import _drop_keys
from worker.service import Worker
from worker.sim import SimEngine

GRACE_S = 60.0
"""Far past every wait here: a job that held a stop for its grace would time the test out."""
LEFT_WITHIN_S = 5.0
"""A stopped worker whose running jobs nobody waits on has left within this."""
STEP_MS = 5.0
LONG = 4000
"""Tokens: 20 s at STEP_MS, longer than any run of a worker here."""
SHORT = 300
"""Tokens: a stream that ends well within the grace."""
BOUND = 1


@contextlib.asynccontextmanager
async def gateway(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway app for the whole test (workers come and go), its keys dropped at the end."""
    app = create_app(settings, redis=redis, raw_pubsub=False)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://genq") as client:
                yield client
    finally:
        await _drop_keys(redis, settings.key_prefix)


@dataclass
class Running:
    worker: Worker
    task: asyncio.Task[None]

    async def stop(self, within_s: float) -> None:
        """Stop the worker (a SIGTERM's drain) and wait for it to have left."""
        self.worker.stop()
        await asyncio.wait_for(asyncio.shield(self.task), within_s)


@contextlib.asynccontextmanager
async def serving(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[Running]:
    """A sim worker, up once its heartbeat is in Redis."""
    worker = Worker(settings, SimEngine(step_ms=STEP_MS), redis=redis)
    task = asyncio.create_task(worker.run())
    keys = Keys(settings.key_prefix)
    try:
        while not await redis.exists(keys.worker(worker.st.id)):
            await asyncio.sleep(0.01)
        yield Running(worker, task)
    finally:
        worker.stop(now=True)
        await asyncio.wait_for(asyncio.shield(task), GRACE_S)


async def until(redis: aioredis.Redis, job_key: str, **fields: str) -> dict[str, str]:
    async with asyncio.timeout(LEFT_WITHIN_S):
        while True:
            record: dict[str, str] = await redis.hgetall(job_key)  # type: ignore[misc]
            if all(record.get(k) == v for k, v in fields.items()):
                return record
            await asyncio.sleep(0.01)


async def submit(client: httpx.AsyncClient, max_tokens: int) -> str:
    body = {"model": "sim", "prompt": "hello", "max_tokens": max_tokens}
    r = await client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def test_a_stop_waits_for_the_job_someone_streams_not_for_one_nobody_waits_on(
    settings: Settings, redis: aioredis.Redis
) -> None:
    settings.shutdown_grace_s = GRACE_S
    keys = Keys(settings.key_prefix)
    watcher = redis.pubsub()
    async with gateway(settings, redis) as client, serving(settings, redis) as worker:
        followed, alone = await submit(client, SHORT), await submit(client, LONG)
        await watcher.subscribe(keys.channel(followed))  # as a gateway's open stream does
        for job_id in (followed, alone):
            await until(redis, keys.job(job_id), status="running")
        stopping = asyncio.create_task(worker.stop(GRACE_S))
        record = await until(redis, keys.job(alone), status="queued")
        assert record["interruptions"] == "1" and record["attempt"] == "1"
        assert (await redis.hget(keys.job(followed), "status")) == "running"  # type: ignore[misc]
        await stopping
        record = await redis.hgetall(keys.job(followed))  # type: ignore[misc]
        assert record["status"] == "succeeded" and record["attempt"] == "1"
        assert record["interruptions"] == "0"
    await watcher.aclose()


async def test_a_job_interrupted_more_often_than_the_bound_fails_saying_so(
    settings: Settings, redis: aioredis.Redis
) -> None:
    settings.shutdown_grace_s = GRACE_S
    settings.max_interruptions = BOUND
    keys = Keys(settings.key_prefix)
    async with gateway(settings, redis) as client:
        job_id = ""
        for stop in range(1, BOUND + 2):  # each run of a worker is cut short by its stop
            async with serving(settings, redis) as worker:
                job_id = job_id or await submit(client, LONG)
                await until(redis, keys.job(job_id), status="running", attempt=str(stop))
                await worker.stop(LEFT_WITHIN_S)
            record = await until(redis, keys.job(job_id), status="queued")
            assert record["interruptions"] == str(stop)
        async with serving(settings, redis):
            await until(redis, keys.job(job_id), status="failed")
        job = (await client.get(f"/v1/jobs/{job_id}")).json()
        assert job["error"]["code"] == "interrupted"
        assert f"interrupted by {BOUND + 1} stops" in job["error"]["message"]
        assert job["attempt"] == BOUND + 1
