"""A client that goes away cancels its job, queued or running, streaming or not, and the
worker's slot is free within a second. Also: the queue-depth limit (429). All on `sim-slow`:
one job at a time, slow steps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import cast

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from tests.openai.conftest import (
    API_KEY,
    QUEUE_LIMIT,
    SLOW,
    GenqServer,
    async_wait_until,
    wait_until,
)

SLOT_FREE_S = 1.0
"""The design's promise: a cancelled job's generator slot is free within one second."""
LONG = 8000
"""Tokens: at the slow model's step time, minutes of work."""
SETTLE_S = 5.0
Entries = list[tuple[str, dict[str, str]]]
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi there"}]


class Slow:
    """The slow model's queue and worker, seen from behind the API."""

    def __init__(self, server: GenqServer, db: redis.Redis, native: httpx.Client) -> None:
        self.worker = server.workers[SLOW]
        self.queue = server.keys.queue(SLOW, "interactive")
        self.keys = server.keys
        self.db = db
        self.native = native

    def status(self, job_id: str) -> str | None:
        return cast(str | None, self.db.hget(self.keys.job(job_id), "status"))

    def queued_ids(self) -> list[str]:
        return [f["job"] for _, f in cast(Entries, self.db.xrange(self.queue))]

    def running(self) -> list[str]:
        return list(self.worker.st.running)

    def token_events(self, job_id: str) -> int:
        entries = cast(Entries, self.db.xrange(self.keys.events(job_id)))
        return sum('"type":"token"' in f["d"] for _, f in entries)

    def blocker(self) -> str:
        """A native job that holds the only slot (running) until cancelled."""
        r = self.native.post("/v1/jobs", json={"model": SLOW, "prompt": "x", "max_tokens": LONG})
        job_id: str = r.json()["id"]
        wait_until(lambda: self.running() == [job_id], SETTLE_S, "blocker running")
        return job_id

    def cancel(self, job_id: str) -> None:
        r = self.native.delete(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, (r.text, self.native.get(f"/v1/jobs/{job_id}").text)

    def settled(self) -> bool:
        return not self.running() and not self.db.xlen(self.queue)


@pytest.fixture
def slow(server: GenqServer, db: redis.Redis) -> Iterator[Slow]:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=auth) as native:
        s = Slow(server, db, native)
        wait_until(s.settled, SETTLE_S, "sim-slow idle")
        yield s
        wait_until(s.settled, SETTLE_S, "sim-slow idle after the test")


def test_closing_a_running_stream_cancels_the_job(client: openai.OpenAI, slow: Slow) -> None:
    stream = client.chat.completions.create(model=SLOW, messages=USER, max_tokens=LONG, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"
    assert next(chunks).choices[0].delta.content  # a token: the job is running
    [job_id] = stream.response.headers["x-job-ids"].split(",")
    assert slow.running() == [job_id]
    stream.close()
    wait_until(lambda: slow.status(job_id) == "cancelled", SLOT_FREE_S, "job cancelled")
    wait_until(lambda: not slow.running(), SLOT_FREE_S, "worker slot free")


def test_closing_a_queued_stream_cancels_the_job(client: openai.OpenAI, slow: Slow) -> None:
    blocker = slow.blocker()
    stream = client.chat.completions.create(model=SLOW, messages=USER, max_tokens=5, stream=True)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    [job_id] = stream.response.headers["x-job-ids"].split(",")
    assert slow.status(job_id) == "queued"
    stream.close()
    wait_until(lambda: slow.status(job_id) == "cancelled", SLOT_FREE_S, "job cancelled")
    assert slow.running() == [blocker]
    slow.cancel(blocker)
    wait_until(lambda: not slow.running(), SLOT_FREE_S, "worker slot free")
    assert slow.token_events(job_id) == 0  # it never ran


async def test_abandoning_a_running_request_cancels_the_job(
    aclient: openai.AsyncOpenAI, slow: Slow
) -> None:
    call = asyncio.create_task(
        aclient.completions.create(model=SLOW, prompt="the model", max_tokens=LONG)
    )
    await async_wait_until(lambda: call.done() or slow.running(), SETTLE_S, "job running")
    [job_id] = slow.running()
    await async_wait_until(lambda: slow.token_events(job_id), SETTLE_S, "first token")
    call.cancel()  # the client gives up: httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await call
    await async_wait_until(lambda: slow.status(job_id) == "cancelled", SLOT_FREE_S, "cancelled")
    await async_wait_until(lambda: not slow.running(), SLOT_FREE_S, "worker slot free")


async def test_abandoning_a_queued_request_cancels_the_job(
    aclient: openai.AsyncOpenAI, slow: Slow
) -> None:
    blocker = await asyncio.to_thread(slow.blocker)
    call = asyncio.create_task(
        aclient.chat.completions.create(model=SLOW, messages=USER, max_tokens=5)
    )
    await async_wait_until(
        lambda: call.done() or len(slow.queued_ids()) == 2, SETTLE_S, "request queued"
    )
    job_id = slow.queued_ids()[-1]
    assert slow.status(job_id) == "queued"
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await async_wait_until(lambda: slow.status(job_id) == "cancelled", SLOT_FREE_S, "cancelled")
    assert slow.running() == [blocker]
    slow.cancel(blocker)
    await async_wait_until(lambda: not slow.running(), SLOT_FREE_S, "worker slot free")
    assert slow.token_events(job_id) == 0


def test_a_full_queue_is_429(client: openai.OpenAI, slow: Slow) -> None:
    jobs = [slow.blocker()]
    for _ in range(QUEUE_LIMIT - 1):
        r = slow.native.post("/v1/jobs", json={"model": SLOW, "prompt": "x", "max_tokens": 5})
        jobs.append(r.json()["id"])
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model=SLOW, messages=USER)
        assert err.value.status_code == 429 and err.value.code == "queue_full"
        assert int(err.value.response.headers["retry-after"]) >= 1
    finally:
        for job_id in reversed(jobs):
            slow.cancel(job_id)
