"""Idempotency (issue 13, item 6): twenty concurrent identical requests with one
Idempotency-Key make one job and all name it; the OpenAI routes honour the key too: the same
key and body answer the same completion (the same stream, from its start), several jobs of
one request are keyed as one, another body is a 422."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.settings import Settings
from tests.conftest import REDIS_URL, gateway_only, running_stack

CONCURRENT = 20
ROUNDS = 20
JITTER_S = 0.003
"""Most delay the proxy adds to each chunk: connections overtake one another, as between
gateway processes on a real network."""
CHUNK = 65536
SCAN_COUNT = 10_000


@contextlib.asynccontextmanager
async def _jittery_redis() -> AsyncIterator[aioredis.Redis]:
    """A client of the test Redis through a TCP proxy that delays every chunk by a random
    0-3 ms (order kept within a connection)."""
    target = urlsplit(REDIS_URL)
    rng = random.Random(13)

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(CHUNK):
                await asyncio.sleep(rng.uniform(0, JITTER_S))
                dst.write(data)
                await dst.drain()
        dst.close()

    writers: list[asyncio.StreamWriter] = []
    handlers: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.append(writer)
        up_r, up_w = await asyncio.open_connection(target.hostname, target.port)
        writers.append(up_w)
        try:
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        finally:
            handlers.discard(task)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = aioredis.Redis.from_url(
        f"redis://127.0.0.1:{port}{target.path}", decode_responses=True
    )
    try:
        yield client
    finally:
        await client.aclose()
        server.close()
        # every proxied connection closed and its handler ended before the loop goes: a
        # writer left to the garbage collector warns "loop is closed" in some later test
        for w in writers:
            w.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        for w in writers:  # and those a handler opened upstream while the first ones closed
            w.close()
        await server.wait_closed()


async def _job_ids(redis: aioredis.Redis, keys: Keys) -> set[str]:
    """Every job record under the prefix."""
    pattern = keys.job("*")
    found = redis.scan_iter(match=pattern, count=SCAN_COUNT)
    return {k.split("{", 1)[1].rstrip("}") async for k in found}


async def _queued_ids(redis: aioredis.Redis, keys: Keys) -> list[str]:
    return [f["job"] for _, f in await redis.xrange(keys.queue("sim", "interactive"))]


def _chunks(body: str) -> list[dict]:
    """The data frames of an OpenAI stream, [DONE] left out."""
    frames = [line.removeprefix("data: ") for line in body.splitlines()]
    return [json.loads(f) for f in frames if f.startswith("{")]


async def test_concurrent_identical_posts_make_one_job(settings: Settings) -> None:
    """On the real Redis, through a proxy that makes the requests' commands interleave."""
    async with _jittery_redis() as redis, gateway_only(settings, redis) as client:
        body = {"model": "sim", "prompt": "once only", "max_tokens": 5}
        made: set[str] = set()
        for round_ in range(ROUNDS):
            headers = {"Idempotency-Key": f"order-{round_}"}
            answers = await asyncio.gather(
                *(client.post("/v1/jobs", json=body, headers=headers) for _ in range(CONCURRENT))
            )
            assert sorted(r.status_code for r in answers) == [200] * (CONCURRENT - 1) + [202]
            ids = {r.json()["id"] for r in answers}
            assert len(ids) == 1, f"round {round_}: {len(ids)} jobs"
            made |= ids
        assert sorted(await _queued_ids(redis, Keys(settings.key_prefix))) == sorted(made)


async def test_openai_the_same_key_and_body_is_the_same_completion(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings, redis) as stack:
        c = stack.client
        body = {"model": "sim", "prompt": ["one", "two"], "n": 2, "max_tokens": 6}
        headers = {"Idempotency-Key": "cmpl-7"}
        first = await c.post("/v1/completions", json=body, headers=headers)
        again = await c.post("/v1/completions", json=body, headers=headers)
        assert first.status_code == again.status_code == 200, again.text
        assert again.json() == first.json()  # id, created, every choice's text and usage
        assert again.headers["x-job-ids"] == first.headers["x-job-ids"]
        job_ids = set(first.headers["x-job-ids"].split(","))
        assert len(job_ids) == 4 and await _job_ids(redis, Keys(settings.key_prefix)) == job_ids
        other = await c.post("/v1/completions", json={**body, "n": 1}, headers=headers)
        assert other.status_code == 422
        assert other.json()["error"]["code"] == "idempotency_key_reused"


async def test_openai_concurrent_requests_with_one_key_share_their_jobs(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings, redis) as stack:
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "n": 3}
        headers = {"Idempotency-Key": "chat-burst"}

        async def post() -> httpx.Response:
            return await stack.client.post("/v1/chat/completions", json=body, headers=headers)

        answers = await asyncio.gather(*(post() for _ in range(CONCURRENT)))
        assert {r.status_code for r in answers} == {200}, [r.text for r in answers][:2]
        assert len({json.dumps(r.json(), sort_keys=True) for r in answers}) == 1
        assert len({r.headers["x-job-ids"] for r in answers}) == 1
        assert len(await _job_ids(redis, Keys(settings.key_prefix))) == 3


async def test_openai_a_stream_sent_again_is_the_same_stream_from_its_start(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings, redis) as stack:
        c = stack.client
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "stream me"}],
            "max_tokens": 12,
            "stream": True,
        }
        headers = {"Idempotency-Key": "stream-1"}
        first = await c.post("/v1/chat/completions", json=body, headers=headers)
        again = await c.post("/v1/chat/completions", json=body, headers=headers)
        assert _chunks(again.text) == _chunks(first.text)
        assert len(_chunks(first.text)) > 2 and again.text.endswith("data: [DONE]\n\n")
        unstreamed = await c.post(
            "/v1/chat/completions", json={**body, "stream": False}, headers=headers
        )
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in _chunks(first.text))
        assert unstreamed.json()["choices"][0]["message"]["content"] == text
