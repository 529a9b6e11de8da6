"""/dashboard's data: what a snapshot shows of the fleet and of recent jobs (never a prompt or
an owner), who may read it (an admin key, as a header or as the login cookie's digest), one
reader per gateway process whatever the number of viewers, and the capped recent-jobs stream
written by the scripts that submit and end jobs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.dashboard import hub as hub_module
from gateway.dashboard.auth import COOKIE
from gateway.dashboard.hub import DashboardHub
from shared.keys import Keys
from shared.records import Heartbeat, owner_of
from shared.settings import Settings
from tests.conftest import Stack, gateway_only, running_stack

SECRET_PROMPT = "the secret prompt 7f3a"
ADMIN, USER = "adm-key-1", "user-key-1"
STREAM_NODE_ENTRIES = 100
"""Redis trims a stream with `MAXLEN ~` by whole nodes (stream-node-max-entries, 100): a
capped stream may hold up to that many more entries than its cap."""


def _keyed(settings: Settings, **more: object) -> Settings:
    return Settings(**{**settings.model_dump(), "api_keys": USER, "admin_keys": ADMIN, **more})


async def _snapshot(client: httpx.AsyncClient, **headers: str) -> dict[str, Any]:
    r = await client.get("/dashboard/snapshot", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


LONG_TOKENS = 5000
"""At 1 ms a step: seconds of running."""


async def _until(client: httpx.AsyncClient, check: Any, timeout: float = 10.0) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            snap = await _snapshot(client)
            if check(snap):
                return snap
            await asyncio.sleep(0.05)


async def test_a_snapshot_shows_the_worker_queue_model_and_a_finished_job(stack: Stack) -> None:
    job = await stack.submit(prompt=SECRET_PROMPT, max_tokens=5)
    await stack.wait_status(job["id"], "succeeded")

    def shown(s: dict[str, Any]) -> bool:
        return any(j["id"] == job["id"] and j["status"] == "succeeded" for j in s["jobs"])

    snap = await _until(stack.client, shown)
    (worker,) = snap["workers"]
    assert worker["id"] == stack.worker.st.id and worker["model"] == "sim"
    assert worker["capacity"] == stack.worker.st.engine.max_batch
    assert worker["beat_at"] is not None and worker["kv_total"] == 0  # sim: no pages
    assert {(q["model"], q["priority"]) for q in snap["queues"]} >= {
        ("sim", "interactive"),
        ("sim", "batch"),
    }
    (model,) = [m for m in snap["models"] if m["name"] == "sim"]
    assert model["workers"] == 1 and model["simulated"] is True
    row = next(j for j in snap["jobs"] if j["id"] == job["id"])
    assert row["model"] == "sim" and row["priority"] == "interactive"
    assert row["completion_tokens"] == 5 and row["ttft_s"] is not None
    text = json.dumps(snap)
    assert SECRET_PROMPT not in text and owner_of(b"anonymous") not in text
    assert "anonymous" not in text


async def test_a_running_job_shows_its_tokens_so_far(stack: Stack) -> None:
    job = await stack.submit(prompt="the model", max_tokens=LONG_TOKENS)
    await stack.wait_status(job["id"], "running")

    def growing(s: dict[str, Any]) -> bool:
        row = next((j for j in s["jobs"] if j["id"] == job["id"]), None)
        return row is not None and row["status"] == "running" and row["tokens_so_far"] > 0

    first = next(j for j in (await _until(stack.client, growing))["jobs"] if j["id"] == job["id"])
    assert first["completion_tokens"] is None and first["prompt_tokens"] > 0
    later = await _until(
        stack.client,
        lambda s: any(
            j["id"] == job["id"] and j.get("tokens_so_far", 0) > first["tokens_so_far"]
            for j in s["jobs"]
        ),
    )
    assert later  # it grows as the job runs
    await stack.client.delete(f"/v1/jobs/{job['id']}")


async def test_queued_jobs_count_in_their_queue(settings: Settings, redis: aioredis.Redis) -> None:
    async with gateway_only(settings, redis) as client:
        for _ in range(3):
            r = await client.post("/v1/jobs", json={"model": "sim", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 202
        snap = await _snapshot(client)
    (queue,) = [q for q in snap["queues"] if q["model"] == "sim" and q["priority"] == "interactive"]
    assert queue["length"] == 3 and queue["lag"] == 3 and queue["pending"] == 0
    assert [j["status"] for j in snap["jobs"]] == ["queued"] * 3


async def test_the_data_needs_an_admin_key_or_its_cookie(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(_keyed(settings), redis) as stack:
        c = stack.client
        page = await c.get("/dashboard")  # the page holds no data: anyone may load it
        assert page.status_code == 200
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert (await c.get("/dashboard/assets/dashboard.js")).status_code == 200
        for headers in ({}, {"Authorization": f"Bearer {USER}"}, {"X-API-Key": "nope"}):
            r = await c.get("/dashboard/snapshot", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await c.get("/dashboard/events", headers=headers)).status_code == 401
        await _snapshot(c, Authorization=f"Bearer {ADMIN}")
        await _snapshot(c, **{"X-API-Key": ADMIN})

        for wrong in (USER, "nope"):
            r = await c.post("/dashboard/login", json={"key": wrong})
            assert r.status_code == 401 and COOKIE not in r.cookies
        assert (await c.post("/dashboard/login", json={})).status_code == 422
        r = await c.post("/dashboard/login", json={"key": ADMIN})
        assert r.status_code == 204
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/dashboard" in cookie
        token = r.cookies[COOKIE]
        assert ADMIN not in token  # a digest: the cookie cannot be turned back into the key
        c.cookies.set(COOKIE, token)
        await _snapshot(c)
        # The cookie opens the dashboard only, not the API.
        r = await c.post("/v1/jobs", json={"model": "sim", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 401
        c.cookies.set(COOKIE, "0" * 64)
        assert (await c.get("/dashboard/snapshot")).status_code == 401
        c.cookies.clear()
        r = await c.post("/dashboard/logout")
        assert r.status_code == 204 and 'genq_dashboard=""' in r.headers["set-cookie"]


async def test_it_can_be_turned_off(settings: Settings, redis: aioredis.Redis) -> None:
    off = Settings(**{**settings.model_dump(), "dashboard": False})
    async with gateway_only(off, redis) as client:
        assert (await client.get("/dashboard")).status_code == 404
        assert (await client.get("/dashboard/events")).status_code == 404


async def _frames(stream: AsyncIterator[str], n: int) -> list[dict[str, Any]]:
    out = []
    async for chunk in stream:
        if chunk.startswith("event: update"):
            out.append(json.loads(chunk.split("data: ", 1)[1]))
            if len(out) == n:
                break
    return out


async def test_twenty_viewers_share_one_reader_and_get_only_what_changed(
    settings: Settings, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = 0
    real = hub_module.read_fleet

    async def counted(*args: Any) -> Any:
        nonlocal reads
        reads += 1
        return await real(*args)

    monkeypatch.setattr(hub_module, "read_fleet", counted)
    fast = Settings(**{**settings.model_dump(), "dashboard_interval_s": 0.05})
    hub = DashboardHub(fast, redis, Keys(fast.key_prefix))
    try:
        streams = [hub.stream() for _ in range(20)]
        frames = await asyncio.gather(*(_frames(s, 4) for s in streams))
        assert hub.viewers == 20
        for s in streams:
            await s.aclose()
        assert hub.viewers == 0
    finally:
        await hub.close()
    rounds = max(f[-1]["round"] for f in frames)
    assert reads <= rounds + 1  # one read a round, not one per viewer
    for viewer in frames:
        first, *later = viewer
        assert {"models", "queues", "workers", "jobs", "batches"} <= set(first)
        for f in later:  # an idle fleet: nothing changed, so no section is sent again
            assert not {"models", "queues", "workers", "jobs", "batches"} & set(f)
            assert f["now"] >= first["now"]


async def test_the_reader_stops_when_the_last_viewer_leaves(
    settings: Settings, redis: aioredis.Redis
) -> None:
    fast = Settings(**{**settings.model_dump(), "dashboard_interval_s": 0.05})
    hub = DashboardHub(fast, redis, Keys(fast.key_prefix))
    try:
        stream = hub.stream()
        await _frames(stream, 2)
        await stream.aclose()
        task = hub._task
        assert task is not None
        await asyncio.wait_for(task, 2)  # ends by itself: nobody watches
    finally:
        await hub.close()


async def test_the_recent_jobs_stream_is_capped_and_can_be_off(
    settings: Settings, redis: aioredis.Redis
) -> None:
    keys = Keys(settings.key_prefix)
    small = Settings(**{**settings.model_dump(), "recent_jobs": 10})
    async with gateway_only(small, redis) as client:
        for _ in range(3 * STREAM_NODE_ENTRIES):
            r = await client.post("/v1/jobs", json={"model": "sim", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 202
        assert await redis.xlen(keys.recent_jobs()) <= 10 + STREAM_NODE_ENTRIES
        # `MAXLEN ~` keeps at least the cap; how much more depends on where a node ends (its
        # byte limit too, and an entry's size depends on its ID's time): 10 to 50 are shown
        shown = len((await _snapshot(client))["jobs"])
        assert 10 <= shown <= small.dashboard_jobs
    off = Settings(**{**settings.model_dump(), "recent_jobs": 0})
    async with gateway_only(off, redis) as client:
        r = await client.post("/v1/jobs", json={"model": "sim", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 202
        assert await redis.exists(keys.recent_jobs()) == 0


async def test_a_cancelled_queued_job_shows_its_end(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with gateway_only(settings, redis) as client:
        r = await client.post("/v1/jobs", json={"model": "sim", "prompt": "x", "max_tokens": 1})
        job_id = r.json()["id"]
        assert (await _snapshot(client))["jobs"][0]["status"] == "queued"
        assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 200
        entries = await redis.xrange(Keys(settings.key_prefix).recent_jobs())
        assert [e[1]["status"] for e in entries] == ["queued", "cancelled"]
        assert (await _snapshot(client))["jobs"][0]["status"] == "cancelled"


def test_an_older_workers_heartbeat_still_decodes() -> None:
    old = {
        "worker_id": "w1",
        "model": "m",
        "engine": "sim",
        "host": "h",
        "pid": "1",
        "version": "0.0.1",
        "capacity": "8",
        "active": "0",
        "tokens_per_s": "0.0",
        "started_at": "1.0",
    }
    hb = Heartbeat.from_hash(old)
    assert (hb.beat_at, hb.kv_pages_used, hb.kv_pages_total, hb.waiting) == (0.0, 0, 0, 0)
