"""A worker's stop (worker/drain.py) hands back at once a running job nobody waits on any more
(submitted to be streamed, its stream gone), so that such a job, carried over from an earlier
stop, never holds the next one; a job that is wanted without a stream (submitted without one,
as batch lines are) gets the grace and finishes. Every job a stop hands back counts an
interruption; one interrupted more than GENQ_MAX_INTERRUPTIONS times fails with an error
saying so instead of carrying over from stop to stop."""

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
"""A stop hands back a job nobody waits on within this (the old drain: only after the grace),
and a worker whose jobs all went back has left within it."""
WAIT_S = 20.0
"""Bounds the waits for progress (a job running, failed): generous, for a busy machine."""
STEP_MS = 5.0
LONG = 4000
"""Tokens: 20 s at STEP_MS, longer than any run of a worker here."""
SHORT = 300
"""Tokens: a stream that ends well within the grace."""
BOUND = 1
LEASE_S = 10.0
"""Long: a worker paused by a busy machine must not look dead here (one runs at a time)."""
SHORT_GRACE_S = 0.2
"""A grace no run of the long job fits in."""


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

    async def first_job(self) -> str:
        """The id of the first job it runs, once it does."""
        async with asyncio.timeout(WAIT_S):
            while not self.worker.st.running:
                await asyncio.sleep(0.01)
        return next(iter(self.worker.st.running))

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


async def until(
    redis: aioredis.Redis, job_key: str, within_s: float = WAIT_S, **fields: str
) -> dict[str, str]:
    """The job's record once it has `fields`."""
    record: dict[str, str] = {}
    try:
        async with asyncio.timeout(within_s):
            while True:
                record = await redis.hgetall(job_key)  # type: ignore[misc]
                if all(record.get(k) == v for k, v in fields.items()):
                    return record
                await asyncio.sleep(0.01)
    except TimeoutError:
        shown = {k: v for k, v in record.items() if k != "spec"}
        raise AssertionError(f"the job never had {fields}: {shown}") from None


async def submit(client: httpx.AsyncClient, max_tokens: int) -> str:
    body = {"model": "sim", "prompt": "hello", "max_tokens": max_tokens}
    r = await client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def test_a_stop_hands_back_at_once_a_job_whose_stream_is_gone_and_lets_a_wanted_one_finish(
    settings: Settings, redis: aioredis.Redis
) -> None:
    settings.shutdown_grace_s, settings.lease_s = GRACE_S, LEASE_S
    keys = Keys(settings.key_prefix)
    async with gateway(settings, redis) as client, serving(settings, redis) as worker:
        body = {"model": "sim", "prompt": "hello", "max_tokens": LONG, "stream": True}
        streaming = asyncio.create_task(client.post("/v1/jobs", json=body))
        gone = await worker.first_job()
        wanted = await submit(client, SHORT)  # no stream: wanted all the same
        streaming.cancel()  # its client goes (the job is not cancelled with it)
        with contextlib.suppress(asyncio.CancelledError):
            await streaming
        await until_nobody_listens(redis, keys.channel(gone))
        for job_id in (gone, wanted):
            await until(redis, keys.job(job_id), status="running")
        stopping = asyncio.create_task(worker.stop(GRACE_S))
        record = await until(redis, keys.job(gone), LEFT_WITHIN_S, status="queued")
        assert record["interruptions"] == "1" and record["attempt"] == "1"
        await stopping
        record = await redis.hgetall(keys.job(wanted))  # type: ignore[misc]
        assert record["status"] == "succeeded" and record["attempt"] == "1"
        assert record["interruptions"] == "0"


async def until_nobody_listens(redis: aioredis.Redis, channel: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while (await redis.pubsub_numsub(channel))[0][1]:
            await asyncio.sleep(0.01)


async def test_a_job_interrupted_more_often_than_the_bound_fails_saying_so(
    settings: Settings, redis: aioredis.Redis
) -> None:
    settings.shutdown_grace_s, settings.lease_s = SHORT_GRACE_S, LEASE_S
    settings.max_interruptions = BOUND
    keys = Keys(settings.key_prefix)
    async with gateway(settings, redis) as client:
        job_id = ""
        for stop in range(1, BOUND + 2):  # each run of a worker is cut short by its stop
            async with serving(settings, redis) as worker:
                job_id = job_id or await submit(client, LONG)
                await until(redis, keys.job(job_id), status="running", attempt=str(stop))
                await worker.stop(LEFT_WITHIN_S)
            record = await until(redis, keys.job(job_id), LEFT_WITHIN_S, status="queued")
            assert record["interruptions"] == str(stop)
        async with serving(settings, redis):
            await until(redis, keys.job(job_id), status="failed")
        job = (await client.get(f"/v1/jobs/{job_id}")).json()
        assert job["error"]["code"] == "interrupted"
        assert f"interrupted by {BOUND + 1} stops" in job["error"]["message"]
        assert job["attempt"] == BOUND + 1
