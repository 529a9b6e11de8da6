"""Fairness between API keys when workers claim (issue 13, item 3): one key's backlog cannot
starve another key's interactive work, and the large backlog still progresses."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from shared.settings import Settings
from tests.conftest import running_stack

A, B = "key-a", "key-b"
BACKLOG = 60
LONG_TOKENS = 60
SLOTS = 4
PROBE_QUEUE_S = 1.5
"""How long another key's job may wait: a slot or two turning over, not A's whole backlog
(60 jobs over 4 slots: about 15 turns, several seconds)."""


BATCH_JOB_S = 2.0
"""A batch job of the reserve test: 400 tokens at 5 ms a step."""


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_one_keys_backlog_does_not_starve_another_keys_job(
    settings: Settings, redis: aioredis.Redis
) -> None:
    keyed = Settings(
        **{**settings.model_dump(), "api_keys": [A, B], "max_batch": SLOTS, "fair_share_jobs": 4}
    )
    async with running_stack(keyed, redis, step_ms=5) as stack:
        body = {"model": "sim", "prompt": "the model", "max_tokens": LONG_TOKENS}
        backlog = []
        for i in range(BACKLOG):
            r = await stack.client.post("/v1/jobs", json={**body, "seed": i}, headers=_h(A))
            assert r.status_code == 202, r.text
            backlog.append(r.json()["id"])
        r = await stack.client.post("/v1/jobs", json={**body, "max_tokens": 3}, headers=_h(B))
        probe = r.json()["id"]
        async with asyncio.timeout(30):
            while True:
                view = (await stack.client.get(f"/v1/jobs/{probe}", headers=_h(B))).json()
                if view["status"] == "succeeded":
                    break
                await asyncio.sleep(0.02)
        assert view["timings"]["queue_s"] < PROBE_QUEUE_S, view["timings"]
        done = 0
        for job_id in backlog:  # A's backlog went on meanwhile, and finishes
            view = (await stack.client.get(f"/v1/jobs/{job_id}", headers=_h(A))).json()
            done += view["status"] in ("running", "succeeded")
        assert done >= SLOTS


async def test_an_interactive_job_behind_a_full_batch_backlog_starts_at_once(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """Batch work never takes the last slots (GENQ_INTERACTIVE_RESERVE): an interactive job
    starts without waiting for a batch job to end (issue 14: TTFT with a backlog)."""
    slots = 8
    reserved = Settings(**{**settings.model_dump(), "max_batch": slots, "interactive_reserve": 2})
    async with running_stack(reserved, redis, step_ms=5) as stack:
        body = {"model": "sim", "prompt": "the model", "max_tokens": 400, "priority": "batch"}
        batch = [(await stack.submit(**body, seed=i))["id"] for i in range(40)]
        async with asyncio.timeout(10):  # the batch fills what it may
            while len(stack.worker.st.running) < slots - 2:
                await asyncio.sleep(0.01)
        probe = await stack.submit(prompt="now", max_tokens=3)
        done = await stack.wait_status(probe["id"], "succeeded", timeout=10)
        assert done["timings"]["queue_s"] < BATCH_JOB_S / 4, done["timings"]
        statuses = [(await stack.client.get(f"/v1/jobs/{j}")).json()["status"] for j in batch]
        assert "failed" not in statuses and "running" in statuses  # the backlog goes on
