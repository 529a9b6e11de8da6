"""Admission control (issue 13, item 3, the gateway side): limits on the jobs and tokens queued
or running per model and priority, for everyone and per API key, answered with 429 and
Retry-After; concurrent gateways cannot overshoot them; the counters fall when jobs end and
are repaired when a job ends unseen; a per-key request rate shared by all gateways; the
OpenAI queue-depth limit covers the native API too."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.admission import AdmissionControl
from shared.deadlines import expire_due
from shared.keys import Keys, scope_fields
from shared.records import owner_of
from shared.settings import PriorityLimits, Settings
from shared.transitions import ScriptRunner
from tests.conftest import gateway_only, gateways, running_stack

A, B = "key-a", "key-b"
JOB = {"model": "sim", "prompt": "x", "max_tokens": 8}
WAIT_S = 10.0
POLL_S = 0.02


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _with(settings: Settings, **more: object) -> Settings:
    return Settings(**{**settings.model_dump(), **more})


async def _counts(redis: aioredis.Redis, settings: Settings) -> dict[str, str]:
    return await redis.hgetall(Keys(settings.key_prefix).admission_counts())


def _refused(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == code
    assert int(r.headers["retry-after"]) >= 1


async def test_the_queued_jobs_limit_is_per_model_and_priority(
    settings: Settings, redis: aioredis.Redis
) -> None:
    limited = _with(settings, max_queued_jobs="interactive=3,batch=1")
    async with gateway_only(limited, redis) as c:
        ids = [(await c.post("/v1/jobs", json=JOB)).json()["id"] for _ in range(3)]
        full = await c.post("/v1/jobs", json=JOB)
        _refused(full, "queue_full")
        message = full.json()["error"]["message"]
        assert "GENQ_MAX_QUEUED_JOBS" in message and "3" in message
        assert (await c.post("/v1/jobs", json={**JOB, "priority": "batch"})).status_code == 202
        _refused(await c.post("/v1/jobs", json={**JOB, "priority": "batch"}), "queue_full")
        assert (await c.delete(f"/v1/jobs/{ids[0]}")).status_code == 200  # a slot frees
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 202


async def test_the_queued_tokens_limit_counts_prompt_and_max_tokens(
    settings: Settings, redis: aioredis.Redis
) -> None:
    limited = _with(settings, max_queued_tokens="interactive=100")
    async with gateway_only(limited, redis) as c:
        body = {**JOB, "max_tokens": 40}  # the prompt is 1 token: 41 each
        assert (await c.post("/v1/jobs", json=body)).status_code == 202
        assert (await c.post("/v1/jobs", json=body)).status_code == 202
        full = await c.post("/v1/jobs", json=body)
        _refused(full, "queue_full")
        assert full.json()["error"]["param"] == "max_tokens"
        assert "82 tokens" in full.json()["error"]["message"]
        assert (await c.post("/v1/jobs", json={**JOB, "max_tokens": 10})).status_code == 202
        never = await c.post("/v1/jobs", json={**JOB, "max_tokens": 200})
        assert never.status_code == 400 and "GENQ_MAX_QUEUED_TOKENS" in never.text


async def test_one_keys_backlog_leaves_other_keys_room(
    settings: Settings, redis: aioredis.Redis
) -> None:
    limited = _with(
        settings,
        api_keys=[A, B],
        max_queued_jobs_per_key="interactive=2",
        max_queued_tokens_per_key="interactive=1000",
    )
    async with gateway_only(limited, redis) as c:
        for _ in range(2):
            assert (await c.post("/v1/jobs", json=JOB, headers=_h(A))).status_code == 202
        full = await c.post("/v1/jobs", json=JOB, headers=_h(A))
        _refused(full, "quota_exceeded")
        assert "GENQ_MAX_QUEUED_JOBS_PER_KEY" in full.json()["error"]["message"]
        assert (await c.post("/v1/jobs", json=JOB, headers=_h(B))).status_code == 202
        owner = owner_of(A.encode())
        jobs_field, tokens_field = scope_fields("interactive", "sim", owner)
        counts = await _counts(redis, limited)
        assert counts[jobs_field] == "2" and counts[tokens_field] == str(2 * (1 + 8))


async def test_concurrent_gateways_cannot_overshoot_a_limit(
    settings: Settings, redis: aioredis.Redis
) -> None:
    limit, tries = 10, 40
    limited = _with(settings, max_queued_jobs={"interactive": limit})
    async with gateways(limited, redis, 2) as clients:
        answers = await asyncio.gather(
            *(clients[i % 2].post("/v1/jobs", json=JOB) for i in range(tries))
        )
        codes = sorted(r.status_code for r in answers)
        assert codes == [202] * limit + [429] * (tries - limit)
        queue = Keys(limited.key_prefix).queue("sim", "interactive")
        assert await redis.xlen(queue) == limit


async def test_the_openai_queue_depth_covers_the_native_api_with_retry_after(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with gateway_only(_with(settings, openai_max_queue_depth=2), redis) as c:
        for _ in range(2):
            assert (await c.post("/v1/jobs", json=JOB)).status_code == 202
        full = await c.post("/v1/jobs", json=JOB)
        _refused(full, "queue_full")
        assert "GENQ_OPENAI_MAX_QUEUE_DEPTH" in full.json()["error"]["message"]


async def test_jobs_stop_counting_when_they_end(settings: Settings, redis: aioredis.Redis) -> None:
    """Cancelled while queued (SETTLE), cancelled while running and succeeded (the worker's
    EMIT of the end): every count goes back to none."""
    async with running_stack(settings, redis, max_batch=1) as stack:
        c = stack.client
        long = await stack.submit(prompt="long", max_tokens=8000)
        await stack.wait_status(long["id"], "running")
        queued = await stack.submit(prompt="queued", max_tokens=3)  # behind it: one slot
        jobs_field, _ = scope_fields("interactive", "sim")
        assert (await _counts(redis, settings))[jobs_field] == "2"
        assert (await c.delete(f"/v1/jobs/{queued['id']}")).json()["status"] == "cancelled"
        assert (await _counts(redis, settings))[jobs_field] == "1"
        await c.delete(f"/v1/jobs/{long['id']}")
        await stack.wait_status(long["id"], "cancelled")
        done = await stack.submit(prompt="short", max_tokens=3)
        await stack.wait_status(done["id"], "succeeded")
        assert await _counts(redis, settings) == {}
        keys = Keys(settings.key_prefix)
        assert await redis.hlen(keys.admission_jobs()) == 0
        assert await redis.zcard(keys.admission_checks()) == 0


async def test_a_job_in_the_queue_past_its_deadline_stops_counting(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with gateway_only(settings, redis) as c:
        job_id = (await c.post("/v1/jobs", json={**JOB, "timeout_s": 0.05})).json()["id"]
        assert await _counts(redis, settings)
        keys, runner = Keys(settings.key_prefix), ScriptRunner(redis)
        async with asyncio.timeout(WAIT_S):
            while job_id not in await expire_due(redis, runner, keys, settings, 10):
                await asyncio.sleep(POLL_S)
        assert await _counts(redis, settings) == {}


async def test_a_job_that_ended_unseen_stops_counting_at_its_check(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """A job ended by a worker older than the counters (which does not take it off), one
    whose record was deleted by hand: the repair's check releases them; a queued job stays."""
    quick = _with(settings, quota_recheck_s=0.01)
    async with gateway_only(quick, redis) as c:
        keys = Keys(settings.key_prefix)
        ended, live, gone = [(await c.post("/v1/jobs", json=JOB)).json()["id"] for _ in range(3)]
        await redis.hset(keys.job(ended), "status", "succeeded")  # an old worker's EMIT
        await redis.delete(keys.job(gone))
        jobs_field, _ = scope_fields("interactive", "sim")
        assert (await _counts(redis, settings))[jobs_field] == "3"
        checks = keys.admission_checks()
        async with asyncio.timeout(WAIT_S):  # all three due their check
            while await redis.zcount(checks, "-inf", repr(time.time())) < 3:
                await asyncio.sleep(POLL_S)
        gateway = AdmissionControl(quick, redis, ScriptRunner(redis), keys)
        assert await gateway.repair() == 2
        assert (await _counts(redis, settings))[jobs_field] == "1"
        assert await redis.hkeys(keys.admission_jobs()) == [keys.job(live)]
        assert await gateway.repair() == 0


async def test_a_keys_request_rate_is_shared_by_allgateways(
    settings: Settings, redis: aioredis.Redis
) -> None:
    limited = _with(settings, api_keys=[A, B], rate_limit_per_key=0.5, rate_limit_burst=2)
    async with gateways(limited, redis, 2) as (one, two):
        unknown = f"/v1/jobs/{'e' * 32}"
        first = await one.get(unknown, headers=_h(A))
        assert first.status_code == 404  # every answer tells the bucket, errors too
        assert _rate(first) == ("2", "1", "2s")  # a full bucket of 2 less 1: full in 2 s
        second = await two.get(unknown, headers=_h(A))
        assert second.status_code == 404 and _rate(second)[:2] == ("2", "0")
        over = await one.get(unknown, headers=_h(A))
        _refused(over, "rate_limited")
        assert int(over.headers["retry-after"]) == 2  # one request every 2 s
        assert _rate(over)[1] == "0" and "x-ratelimit-limit-tokens" not in over.headers
        assert "30 requests per minute" in over.json()["error"]["message"]
        _refused(await two.post("/v1/jobs", json=JOB, headers=_h(A)), "rate_limited")
        other = await two.post("/v1/jobs", json=JOB, headers=_h(B))
        assert other.status_code == 202 and _rate(other)[:2] == ("2", "1")


def _rate(r: httpx.Response) -> tuple[str, str, str]:
    """The request rate's headers: limit, remaining, reset."""
    h = r.headers
    limit, remaining = h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]
    return limit, remaining, h["x-ratelimit-reset-requests"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("7", PriorityLimits(interactive=7, batch=7)),
        ("interactive=5", PriorityLimits(interactive=5, batch=1_000_000)),
        (" batch = 3 , interactive=0", PriorityLimits(interactive=0, batch=3)),
        ('{"batch": 9}', PriorityLimits(interactive=10_000, batch=9)),
    ],
)
def test_limits_are_one_number_or_one_per_priority(
    monkeypatch: pytest.MonkeyPatch, env: str, expected: PriorityLimits
) -> None:
    monkeypatch.setenv("GENQ_MAX_QUEUED_JOBS", env)
    assert Settings().max_queued_jobs == expected
