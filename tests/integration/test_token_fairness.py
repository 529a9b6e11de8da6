"""Token-fair scheduling between API keys (GENQ_FAIR_SCHEDULING=tokens): two keys both
backlogged share the workers by the tokens their jobs cost, whatever their prompts' length
and whichever queued first (a long prompt costs its uncached part, at
GENQ_FAIR_PREFILL_WEIGHT a token: here its shared prefix is cached); weights
(GENQ_KEY_WEIGHTS) split them in proportion."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import redis.asyncio as aioredis

from shared.settings import Settings
from tests.conftest import Stack, running_stack

pytestmark = pytest.mark.parametrize("redis", ["redis"], indirect=True)

A, B = "key-a", "key-b"
JOBS = 90
TOKENS = 10
SLOTS = 4
LET_IN = 2 * SLOTS  # the queue's fair window (GENQ_FAIR_WINDOW, 4) and a batch's claims
LONG_PROMPT = " ".join(["the model queue worker gateway stream"] * 100)  # ~600 tokens


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def backlog_shares(
    stack: Stack, prompts: dict[str, str], window: int, tokens: dict[str, int] | None = None
) -> dict[str, float]:
    """Each key queues JOBS jobs (A first, then B); the share of the generated tokens each
    got among `window` jobs the worker started once both were queued (both backlogged:
    neither can run out within the window). The first LET_IN of those are left out: A's jobs
    let into the queue (or claimed ahead) while A was alone, before B's came, which start
    after whatever B queues: work-conserving, not a share (up to 4 of them put A's share of
    the first 40 at 0.62 where the rest held 0.5)."""
    for key, prompt in prompts.items():  # each key's prompt cached first, as a live one is
        r = await stack.client.post(
            "/v1/jobs", json={"model": "sim", "prompt": prompt, "max_tokens": 1}, headers=_h(key)
        )
        await done(stack, r.json()["id"], key)
    await asyncio.sleep(0.5)  # a heartbeat publishes the worker's cache; placement reads it
    ids: dict[str, str] = {}
    for key, prompt in prompts.items():
        for i in range(JOBS):
            n = (tokens or {}).get(key, TOKENS)
            body = {"model": "sim", "prompt": f"{prompt} {i}", "max_tokens": n, "seed": i}
            r = await stack.client.post("/v1/jobs", json=body, headers=_h(key))
            assert r.status_code == 202, r.text
            ids[r.json()["id"]] = key
    both_queued = time.time()
    started: list[tuple[float, str, int]] = []
    for job_id, key in ids.items():
        view = await done(stack, job_id, key)
        started.append((view["started_at"], key, view["usage"]["completion_tokens"]))
    first = sorted(s for s in started if s[0] >= both_queued)[LET_IN : LET_IN + window]
    tokens = Counter[str]()
    for _, key, n in first:
        tokens[key] += n
    total = sum(tokens.values())
    return {key: tokens[key] / total for key in prompts}


async def done(stack: Stack, job_id: str, key: str) -> dict:
    async with asyncio.timeout(60):
        while True:
            view = (await stack.client.get(f"/v1/jobs/{job_id}", headers=_h(key))).json()
            if view["status"] == "succeeded":
                return view
            assert view["status"] in ("queued", "running"), view  # ended otherwise: say how
            await asyncio.sleep(0.02)


def keyed(settings: Settings, **more: object) -> Settings:
    return Settings(**{**settings.model_dump(), "api_keys": [A, B], "max_batch": SLOTS, **more})


async def test_backlogged_keys_share_by_tokens_whatever_their_jobs_sizes(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(keyed(settings), redis, step_ms=10) as stack:
        shares = await backlog_shares(
            stack, {A: LONG_PROMPT, B: "short"}, window=40, tokens={A: 3 * TOKENS, B: TOKENS}
        )
    assert 0.4 <= shares[A] <= 0.6, shares  # by jobs in flight, A's long jobs took 3/4


async def test_weights_three_to_one_give_three_quarters(
    settings: Settings, redis: aioredis.Redis
) -> None:
    weighted = keyed(settings, key_weights={A: 1.0, B: 3.0})
    async with running_stack(weighted, redis, step_ms=10) as stack:
        shares = await backlog_shares(stack, {A: "the model", B: "the model"}, window=40)
    assert 0.65 <= shares[B] <= 0.85, shares


async def test_a_full_batchs_freed_slot_goes_to_the_next_job_at_once(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """Every slot busy and the jobs near their end: the claimer's read for batch work to take
    ahead must end when a slot comes free, since the next interactive jobs wait in the
    token-fair queue for free slots (they used to wait out the whole blocking read,
    GENQ_CLAIM_BLOCK_MS, at each wave past the first few)."""
    slow_read = keyed(settings, api_keys=[A], claim_block_ms=2000)
    async with running_stack(slow_read, redis, step_ms=10) as stack:
        ids = []
        for i in range(6 * SLOTS):  # six waves: the first two go into the queue at submit
            body = {"model": "sim", "prompt": f"wave {i}", "max_tokens": TOKENS, "seed": i}
            r = await stack.client.post("/v1/jobs", json=body, headers=_h(A))
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        views = [await done(stack, job_id, A) for job_id in ids]
    span = max(v["finished_at"] for v in views) - min(v["created_at"] for v in views)
    assert span < 3.0, sorted(v["started_at"] - views[0]["created_at"] for v in views)
