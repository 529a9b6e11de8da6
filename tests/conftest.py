"""Fixtures: real Redis (127.0.0.1:6379) or fakeredis through one `redis` fixture, a sim worker
and the gateway app in-process, each test under its own key prefix."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis

from gateway.app import create_app
from shared.keys import Keys
from shared.settings import Settings
from tests.cluster import ClusterUnavailable, LocalCluster, local_cluster
from tests.prefixes import RUN_PREFIX, test_prefix
from worker.link import EngineLink
from worker.service import Worker
from worker.sim import SimEngine

REDIS_URL = os.environ.get("GENQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session", autouse=True)
def _drop_this_runs_keys() -> object:
    """Whatever a test left in the developer's Redis (its processes, a failed cleanup) goes."""
    yield
    import redis as sync_redis

    with contextlib.suppress(sync_redis.RedisError, OSError):
        client = sync_redis.Redis.from_url(REDIS_URL)
        batch = [k for k in client.scan_iter(match=f"{RUN_PREFIX}*", count=1000)]
        for i in range(0, len(batch), 1000):
            client.delete(*batch[i : i + 1000])
        client.close()


@pytest.fixture(autouse=True)
def _own_signal_handlers() -> Iterator[None]:
    """SIGINT and SIGTERM as they were before each test: code run in-process (a worker's
    stop ignores both as it leaves) must not leave this process ignoring them, which every
    process a later test starts would inherit (a CLI's Ctrl-C test then waits in vain)."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in kept.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def _data_homes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data-home")


@pytest.fixture(autouse=True)
def _own_data_home(_data_homes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`genq serve` keeps its private Redis's data under $XDG_DATA_HOME: each test's under a
    folder of its own (made only when used), never the developer's, never another test's."""
    monkeypatch.setenv("XDG_DATA_HOME", str(_data_homes / uuid.uuid4().hex))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A private Redis Cluster (3 primaries, 3 replicas) for one test module; skipped, saying
    why, where this box cannot start one."""
    with contextlib.ExitStack() as stack:
        try:
            made = stack.enter_context(local_cluster())
        except ClusterUnavailable as exc:
            pytest.skip(str(exc))
        yield made


@pytest.fixture(params=["redis", "fakeredis"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    """A Redis client: the real server, or fakeredis (in-process) for speed."""
    if request.param == "redis":
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    else:
        client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def settings() -> Settings:
    return Settings(
        redis_url=REDIS_URL,
        key_prefix=test_prefix(),
        sim_step_ms=1.0,
        heartbeat_s=0.2,
        lease_s=1.0,
        claim_block_ms=200,
        shutdown_grace_s=2.0,
    )


@dataclass
class Stack:
    settings: Settings
    redis: aioredis.Redis
    client: httpx.AsyncClient
    worker: Worker

    async def submit(self, **body: object) -> dict:
        body.setdefault("model", "sim")
        r = await self.client.post("/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        return r.json()

    async def wait_status(self, job_id: str, *statuses: str, timeout: float = 10.0) -> dict:
        async with asyncio.timeout(timeout):
            while True:
                job = (await self.client.get(f"/v1/jobs/{job_id}")).json()
                if job["status"] in statuses:
                    return job
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running_stack(
    settings: Settings,
    redis: aioredis.Redis,
    engine: type[SimEngine] = SimEngine,
    link: EngineLink | None = None,
    **engine_options: object,
) -> AsyncIterator[Stack]:
    """A gateway app and a worker: one of `engine` (the sim, or a test's variant of it) on a
    thread of this process, or `link` (an engine process's: `EngineProcess.spawn`)."""
    options: dict = {"step_ms": settings.sim_step_ms, "max_batch": settings.max_batch}
    options.update(engine_options)
    worker = Worker(settings, link or engine(**options), redis=redis)
    task = asyncio.create_task(worker.run())
    raw_pubsub = not isinstance(redis, fakeredis.FakeAsyncRedis)  # real Redis: genq's own reader
    app = create_app(settings, redis=redis, raw_pubsub=raw_pubsub)
    try:
        async with app.router.lifespan_context(app):
            while not await redis.exists(worker.st.keys.model_card(worker.st.model)):
                await asyncio.sleep(0.01)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://genq") as client:
                yield Stack(settings, redis, client, worker)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        await _drop_keys(redis, settings.key_prefix)


@contextlib.asynccontextmanager
async def gateway_only(
    settings: Settings, redis: aioredis.Redis
) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway app with the sim model's card, as a worker writes it, but no worker: jobs
    stay queued. The client sends no API key of its own."""
    engine = SimEngine()
    keys = Keys(settings.key_prefix)
    card = {"card": engine.card.model_dump_json(), "tokenizer": engine.tokenizer_json}
    await redis.hset(keys.model_card(engine.card.name), mapping=card)  # type: ignore[misc,arg-type]
    await redis.sadd(keys.models(), engine.card.name)  # type: ignore[misc]
    app = create_app(settings, redis=redis, raw_pubsub=False)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://genq") as client:
                yield client
    finally:
        await _drop_keys(redis, settings.key_prefix)


@contextlib.asynccontextmanager
async def gateways(
    settings: Settings, redis: aioredis.Redis, n: int
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """`n` gateway apps (each its own process state) on one Redis, no worker."""
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(gateway_only(settings, redis))
        clients = [first]
        for _ in range(n - 1):
            app = create_app(settings, redis=redis, raw_pubsub=False)
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            clients.append(
                await stack.enter_async_context(
                    httpx.AsyncClient(transport=transport, base_url="http://genq")
                )
            )
        yield clients


@pytest.fixture
async def stack(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[Stack]:
    async with running_stack(settings, redis) as s:
        yield s


async def _drop_keys(redis: aioredis.Redis, prefix: str) -> None:
    keys = [k async for k in redis.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await redis.delete(*keys)


def parse_sse(body: str) -> list[tuple[int, str, dict]]:
    """(seq, type, data) of each SSE frame; comment lines skipped."""
    events = []
    for frame in body.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in frame.splitlines() if line and not line.startswith(":")
        )
        if "data" in fields:
            events.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
    return events
