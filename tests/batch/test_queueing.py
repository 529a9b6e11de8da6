"""How a batch reaches the queue, with the gateway app in-process over the real Redis: lines
sharing a prompt prefix are queued together, a chunk queued twice makes no job twice, the
sweep finds ends the tracker never saw, and checking a large upload leaves the event loop
free for other requests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.app import create_app
from gateway.batch.queueing import QUEUE_GROUP
from gateway.batch.runtime import BatchRuntime
from shared.batches import BatchRecord
from shared.keys import Keys
from shared.records import JobRecord
from shared.settings import Settings
from tests.conftest import REDIS_URL
from worker.service import Worker
from worker.sim import SimEngine

PREFIXES = 3
WAIT_S = 20.0
POLL_S = 0.02
STALL_SHARE = 0.25
"""The longest the event loop may go unserved while a large upload is checked, as a share of
the upload's time (a share, not seconds: the box may be busy with more than this test; an
upload checked without yielding stalls the loop for nearly all of it)."""
TICK_S = 0.005
SMALL_CHUNK_BYTES = 4096
ONE_CHUNK_BYTES = 64 * 1024 * 1024
STOP_WITHIN_S = 5.0


@dataclass
class Gateway:
    client: httpx.AsyncClient
    redis: aioredis.Redis
    settings: Settings
    runtime: BatchRuntime


async def _publish_card(redis: aioredis.Redis, settings: Settings) -> None:
    """The card a sim worker writes when it starts: jobs can be queued, none will run."""
    engine = SimEngine()
    k = Keys(settings.key_prefix)
    mapping = {"card": engine.card.model_dump_json(), "tokenizer": engine.tokenizer_json}
    await redis.hset(k.model_card("sim"), mapping=mapping)  # type: ignore[arg-type]
    await redis.sadd(k.models(), "sim")


@contextlib.asynccontextmanager
async def _gateway(
    settings: Settings, chunk_bytes: int, loops: bool = True
) -> AsyncIterator[Gateway]:
    """The gateway app alone: a model card but no worker, so queued jobs stay queued."""
    settings = settings.model_copy(
        update={"batch_poll_s": 0.05, "file_chunk_bytes": chunk_bytes, "batch_loops": loops}
    )
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    await _publish_card(redis, settings)
    app = create_app(settings, redis=redis)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://genq") as client:
                yield Gateway(client, redis, settings, app.state.batch)
    finally:
        keys = [k async for k in redis.scan_iter(match=f"{settings.key_prefix}*", count=10_000)]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


@pytest.fixture
async def gateway(settings: Settings) -> AsyncIterator[Gateway]:
    """Small chunks: a batch of a few dozen lines is queued in several."""
    async with _gateway(settings, SMALL_CHUNK_BYTES) as g:
        yield g


@pytest.fixture
async def one_chunk_gateway(settings: Settings) -> AsyncIterator[Gateway]:
    """Chunks larger than any file here: no storage write breaks up checking a file."""
    async with _gateway(settings, ONE_CHUNK_BYTES) as g:
        yield g


def _line(i: int, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "seed": i}
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}


async def _start(
    client: httpx.AsyncClient, lines: list[dict[str, Any]], trailing: bytes = b""
) -> str:
    content = "".join(json.dumps(x) + "\n" for x in lines).encode() + trailing
    f = await client.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}
    )
    assert f.status_code == 200, f.text
    body = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions"}
    r = await client.post("/v1/batches", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


async def _record(g: Gateway, batch_id: str) -> BatchRecord:
    return BatchRecord.from_hash(await g.redis.hgetall(g.runtime.driver.keys.batch(batch_id)))


async def _all_queued(g: Gateway, batch_id: str) -> BatchRecord:
    async with asyncio.timeout(WAIT_S):
        while True:
            record = await _record(g, batch_id)
            if record.queued_chunks == len(record.chunks):
                return record
            await asyncio.sleep(POLL_S)


async def _queued_lines(g: Gateway) -> list[int]:
    """The batch queue's lines, in queue order."""
    keys = g.runtime.driver.keys
    entries = await g.redis.xrange(keys.queue("sim", "batch"))
    pipe = g.redis.pipeline(transaction=False)
    for _, fields in entries:
        pipe.hgetall(keys.job(fields["job"]))
    return [int(JobRecord.from_hash(raw).metadata["line"]) for raw in await pipe.execute()]


async def test_lines_sharing_a_prefix_are_queued_together(gateway: Gateway) -> None:
    systems = [" ".join([f"system{p}"] * 40) for p in range(PREFIXES)]
    lines = [_line(i, f"{systems[i % PREFIXES]} question {i}") for i in range(24)]
    batch_id = await _start(gateway.client, lines)
    record = await _all_queued(gateway, batch_id)
    assert len(record.chunks) > 1  # grouping works within each chunk
    queued = await _queued_lines(gateway)
    assert sorted(queued) == list(range(1, 25))
    start = 0
    for size in record.chunks:  # within a chunk: one run per prefix
        groups = [(n - 1) % PREFIXES for n in queued[start : start + size]]
        runs = 1 + sum(a != b for a, b in itertools.pairwise(groups))
        assert runs == len(set(groups)), groups
        start += size


async def test_a_chunk_queued_again_makes_no_job_twice(gateway: Gateway) -> None:
    lines = [_line(i, f"prompt {i} " + "x " * 40) for i in range(60)]
    batch_id = await _start(gateway.client, lines)
    record = await _all_queued(gateway, batch_id)
    assert len(record.chunks) > 1
    keys = gateway.runtime.driver.keys
    # as if the driver died after queueing every chunk but before moving its cursor
    await gateway.redis.hset(keys.batch(batch_id), "queued_chunks", "0")
    gateway.runtime.driver.wake()
    await _all_queued(gateway, batch_id)
    assert sorted(await _queued_lines(gateway)) == list(range(1, 61))


async def test_checking_a_large_upload_leaves_the_loop_free(one_chunk_gateway: Gateway) -> None:
    gateway = one_chunk_gateway
    lines = [_line(i, f"a somewhat longer prompt for line {i} " * 3) for i in range(10_000)]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    stalls: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            stalls.append(now - last - TICK_S)
            last = now

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    r = await gateway.client.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", content)}
    )
    took = time.monotonic() - started
    stop.set()
    await task
    assert r.status_code == 200, r.text
    assert max(stalls) < STALL_SHARE * took, f"loop stalled {max(stalls):.3f} s of {took:.2f} s"


async def test_the_sweep_finds_ends_the_tracker_missed(settings: Settings) -> None:
    """With the tracker stopped, no job end is read from the done stream: the driver's sweep
    (a batch without progress for GENQ_BATCH_SWEEP_S) gives every line its result."""
    settings = settings.model_copy(update={"batch_poll_s": 0.05, "batch_sweep_s": 0.5})
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    worker = Worker(settings, SimEngine(step_ms=1), redis=redis)
    running = asyncio.create_task(worker.run())
    app = create_app(settings, redis=redis)
    try:
        async with app.router.lifespan_context(app):
            runtime: BatchRuntime = app.state.batch
            runtime._tasks[1].cancel()  # the tracker
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://genq") as client:
                while not await redis.exists(worker.st.keys.model_card("sim")):
                    await asyncio.sleep(POLL_S)
                lines = [_line(i, f"p {i}") for i in range(5)]
                batch_id = await _start(client, lines, trailing=b"\n\n")  # blanks: no lines
                async with asyncio.timeout(WAIT_S):
                    while True:
                        batch = (await client.get(f"/v1/batches/{batch_id}")).json()
                        if batch["status"] == "completed":
                            break
                        await asyncio.sleep(POLL_S)
        assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    finally:
        worker.stop()
        await asyncio.wait_for(running, WAIT_S)
        keys = [k async for k in redis.scan_iter(match=f"{settings.key_prefix}*", count=10_000)]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


async def test_stopping_survives_a_cancel_turned_into_a_redis_error(gateway: Gateway) -> None:
    """redis-py can turn a cancel that lands inside a read into a RedisError, which the loops
    retry: the gateway's shutdown must still end them."""
    entered = asyncio.Event()

    async def read_that_swallows_cancel() -> None:
        entered.set()
        try:
            await asyncio.sleep(WAIT_S)
        except asyncio.CancelledError:
            raise RedisError("connection closed while reading") from None

    runtime = gateway.runtime
    runtime.tracker.run_once = read_that_swallows_cancel  # type: ignore[method-assign]
    runtime.driver.run_once = read_that_swallows_cancel  # type: ignore[method-assign]
    async with asyncio.timeout(WAIT_S):
        await entered.wait()
    async with asyncio.timeout(STOP_WITHIN_S):
        await runtime.stop()


async def test_a_damaged_batch_does_not_stop_the_others(gateway: Gateway) -> None:
    keys = gateway.runtime.driver.keys
    damaged = await _start(gateway.client, [_line(0, "a")])
    await _all_queued(gateway, damaged)
    await gateway.redis.hset(keys.batch(damaged), "chunks", "not json")
    healthy = await _start(gateway.client, [_line(i, f"b {i}") for i in range(3)])
    record = await _all_queued(gateway, healthy)
    assert record.lines_queued == 3


async def test_a_gateway_without_batch_loops_serves_batches_others_drive(
    settings: Settings,
) -> None:
    """GENQ_BATCH_LOOPS=false: the gateway answers the API; another gateway queues the lines."""
    async with _gateway(settings, SMALL_CHUNK_BYTES, loops=False) as api:
        batch_id = await _start(api.client, [_line(i, f"p {i}") for i in range(3)])
        assert not api.runtime._tasks
        assert (await _record(api, batch_id)).status == "validating"
        async with _gateway(settings, SMALL_CHUNK_BYTES) as driver:
            record = await _all_queued(driver, batch_id)
            assert record.status == "in_progress" and record.lines_queued == 3


async def test_a_chunks_first_lines_are_queued_while_the_rest_are_checked(
    one_chunk_gateway: Gateway,
) -> None:
    """The workers start on a chunk's first group of lines while the driver still checks the
    rest (held here at the line after the first group): the queue is fed ahead of them, not
    a whole chunk at a time."""
    g = one_chunk_gateway
    lines = [_line(i, f"review {i} positive?") for i in range(QUEUE_GROUP * 2 + 10)]
    checker = g.runtime.driver.queuer.checker
    check, held = checker.check, asyncio.Event()

    async def held_after_the_first_group(n: int, raw: bytes) -> Any:
        if n == QUEUE_GROUP + 1:
            await held.wait()
        return await check(n, raw)

    checker.check = held_after_the_first_group  # type: ignore[method-assign]
    batch_id = await _start(g.client, lines)
    queue = g.runtime.driver.keys.queue("sim", "batch")
    try:
        async with asyncio.timeout(WAIT_S):
            while await g.redis.xlen(queue) < QUEUE_GROUP:
                await asyncio.sleep(POLL_S)
        assert (await _record(g, batch_id)).queued_chunks == 0  # the chunk is not done yet
    finally:
        held.set()
    record = await _all_queued(g, batch_id)
    assert len(record.chunks) == 1
    assert sorted(await _queued_lines(g)) == list(range(1, len(lines) + 1))
