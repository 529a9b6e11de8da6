"""Guessing API keys is throttled per client address: past GENQ_AUTH_FAIL_LIMIT failures in a
window, a wrong or missing key gets 429 with Retry-After (the error shape), while a valid key
from that very address still passes and other addresses are unaffected. The table of
addresses stays bounded however many fail."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from gateway.app import create_app
from gateway.auth_throttle import AuthThrottle
from shared.settings import Settings
from tests.conftest import _drop_keys

GOOD, ADMIN = "key-good-0123", "key-admin-456"
LIMIT = 20
ATTEMPTS = 300
WINDOW_S = 60.0

pytestmark = pytest.mark.parametrize("redis", ["fakeredis"], indirect=True)  # Redis is not used


def _keyed(settings: Settings, **more: object) -> Settings:
    values = {
        **settings.model_dump(),
        "api_keys": [GOOD],
        "admin_keys": [ADMIN],
        "auth_fail_limit": LIMIT,
        "auth_fail_window_s": WINDOW_S,
        **more,
    }
    return Settings(**values)


@contextlib.asynccontextmanager
async def _app(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[FastAPI]:
    app = create_app(settings, redis=redis, raw_pubsub=False)
    try:
        async with app.router.lifespan_context(app):
            yield app
    finally:
        await _drop_keys(redis, settings.key_prefix)


def _client(app: FastAPI, address: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 40_000))
    return httpx.AsyncClient(transport=transport, base_url="http://genq")


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_wrong_keys_from_one_address_are_throttled_valid_keys_never(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with (
        _app(_keyed(settings), redis) as app,
        _client(app, "203.0.113.7") as guesser,
        _client(app, "198.51.100.9") as other,
    ):
        statuses = []
        for i in range(ATTEMPTS):
            r = await guesser.get("/v1/models", headers=_bearer(f"guess-{i}"))
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert 1 <= int(r.headers["retry-after"]) <= WINDOW_S
                error = r.json()["error"]
                assert error["code"] == "too_many_auth_failures"
                assert error["type"] == "rate_limit_error"
                assert "GENQ_AUTH_FAIL_LIMIT" in error["message"]
            if i % 50 == 49:  # meanwhile a valid key from the same address is served
                ok = await guesser.get("/v1/models", headers=_bearer(GOOD))
                assert ok.status_code == 200, ok.text
        assert statuses == [401] * LIMIT + [429] * (ATTEMPTS - LIMIT)
        assert (await guesser.get("/v1/models")).status_code == 429  # no key at all: the same
        # another address is unaffected
        assert (await other.get("/v1/models", headers=_bearer("nope"))).status_code == 401
        assert (await other.get("/v1/models", headers=_bearer(GOOD))).status_code == 200
        # the dashboard's login counts in the same table
        login = await guesser.post("/dashboard/login", json={"key": "not-admin"})
        assert login.status_code == 429 and "retry-after" in login.headers
        login = await guesser.post("/dashboard/login", json={"key": ADMIN})
        assert login.status_code == 204


async def test_a_valid_key_is_never_counted(settings: Settings, redis: aioredis.Redis) -> None:
    async with _app(_keyed(settings), redis) as app, _client(app, "192.0.2.1") as c:
        for _ in range(3 * LIMIT):
            assert (await c.get("/v1/models", headers=_bearer(GOOD))).status_code == 200
        # a non-admin but valid key at the admin-only login is refused, never counted
        for _ in range(2 * LIMIT):
            r = await c.post("/dashboard/login", json={"key": GOOD})
            assert r.status_code == 401
        throttle: AuthThrottle = app.state.auth_throttle
        assert len(throttle) == 0
        assert (await c.get("/v1/models", headers=_bearer("wrong"))).status_code == 401


async def test_the_table_stays_bounded(settings: Settings, redis: aioredis.Redis) -> None:
    cap = 50
    keyed = _keyed(settings, auth_fail_max_clients=cap)
    async with _app(keyed, redis) as app:
        throttle: AuthThrottle = app.state.auth_throttle
        for n in range(4 * cap):
            async with _client(app, f"10.0.{n // 250}.{n % 250}") as c:
                assert (await c.get("/v1/models")).status_code == 401
            assert len(throttle) <= cap
        assert len(throttle) == cap


async def test_every_door_that_checks_a_key_counts(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """Readiness details, the dashboard's data and a keyed /metrics tell a right key from a
    wrong one: wrong keys there count too. A probe without a key is never counted nor refused."""
    keyed = _keyed(settings, metrics_require_key=True)
    doors = ("/readyz", "/dashboard/snapshot", "/metrics")
    async with _app(keyed, redis) as app:
        for door in doors:
            async with _client(app, f"192.0.2.{doors.index(door) + 10}") as c:
                statuses = [
                    (await c.get(door, headers=_bearer(f"wrong-{i}"))).status_code
                    for i in range(LIMIT + 1)
                ]
                assert statuses[-1] == 429 and 429 not in statuses[:-1], (door, statuses)
                assert (await c.get(door, headers=_bearer(ADMIN))).status_code == 200, door
        async with _client(app, "192.0.2.10") as c:  # throttled for wrong keys on /readyz
            for _ in range(LIMIT + 1):
                probe = await c.get("/readyz")
                assert probe.status_code == 200 and "pid" not in probe.json()
            assert "pid" in (await c.get("/readyz", headers=_bearer(GOOD))).json()
