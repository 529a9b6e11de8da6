"""Health probes (/healthz, /health, /readyz) and CORS for browser UIs, through the gateway app
in-process over real Redis with a sim worker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.app import EXPOSED_HEADERS
from shared.settings import GatewaySettings, Settings
from tests.conftest import REDIS_URL, Stack, running_stack

KEY = "k1"
UI = "http://ui.example"


@pytest.fixture
async def real_redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def keyed(settings: Settings, real_redis: aioredis.Redis) -> AsyncIterator[Stack]:
    """API keys on."""
    settings.api_keys = [KEY]
    async with running_stack(settings, real_redis) as s:
        yield s


@pytest.fixture
async def browser(settings: Settings, real_redis: aioredis.Redis) -> AsyncIterator[Stack]:
    """API keys on, and a browser UI at UI allowed."""
    settings.api_keys = [KEY]
    settings.cors_origins = [UI]
    async with running_stack(settings, real_redis) as s:
        yield s


async def test_health_answers_as_vllm_and_tgi_serve_it(keyed: Stack) -> None:
    for path in ("/health", "/healthz"):
        r = await keyed.client.get(path)
        assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_readyz_says_which_models_a_live_worker_serves(keyed: Stack) -> None:
    await keyed.redis.sadd(keyed.worker.st.keys.models(), "retired")  # a card, no worker
    r = await keyed.client.get("/readyz", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ready" and body["models"] == {"retired": False, "sim": True}
    assert {"pid", "streams", "rss_mb"} <= set(body)


async def test_readyz_shows_no_process_details_without_a_key(keyed: Stack) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        body = (await keyed.client.get("/readyz", headers=headers)).json()
        assert set(body) == {"status", "models", "capacity"}, body  # counts, no process


async def test_readyz_keeps_its_details_when_the_api_is_open(stack: Stack) -> None:
    body = (await stack.client.get("/readyz")).json()
    assert {"pid", "streams", "rss_mb"} <= set(body)  # genq bench reads streams and rss_mb


def test_cors_origins_take_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENQ_CORS_ORIGINS", f"{UI}, http://localhost:3000")
    assert GatewaySettings().cors_origins == [UI, "http://localhost:3000"]


async def test_a_preflight_is_answered_without_a_key(browser: Stack) -> None:
    r = await browser.client.options(
        "/v1/jobs",
        headers={
            "Origin": UI,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, idempotency-key",
        },
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == UI
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


async def test_a_browser_may_read_the_job_headers(browser: Stack) -> None:
    r = await browser.client.post(
        "/v1/jobs",
        json={"model": "sim", "prompt": "x", "max_tokens": 2, "stream": True},
        headers={"Origin": UI, "Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and r.headers["x-job-id"]
    assert r.headers["access-control-allow-origin"] == UI
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {h.lower() for h in EXPOSED_HEADERS} <= exposed
    assert {"x-job-id", "x-job-ids", "retry-after"} <= exposed


async def test_other_origins_get_no_cors_headers(browser: Stack) -> None:
    r = await browser.client.get("/healthz", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
