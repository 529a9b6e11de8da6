"""Fairness between API keys when workers claim (issue 13, item 3): one key's backlog cannot
starve another key's interactive work, and the large backlog still progresses."""

from __future__ import annotations

import asyncio
import time

import pytest
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


async def test_another_keys_job_starts_at_once_beside_a_backlog_filling_the_batch(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """Both keys interactive, A's backlog of long jobs filling every slot: once B's jobs come
    to the worker, A leaves GENQ_OWNER_RESERVE slots to others, so B's next job starts at
    once, not when one of A's ends."""
    slots = 8
    keyed = Settings(
        **{**settings.model_dump(), "api_keys": [A, B], "max_batch": slots, "owner_reserve": 2}
    )
    async with running_stack(keyed, redis, step_ms=5) as stack:
        body = {"model": "sim", "prompt": "the model", "max_tokens": 400}  # 2 s each
        backlog = []
        for i in range(40):
            r = await stack.client.post("/v1/jobs", json={**body, "seed": i}, headers=_h(A))
            backlog.append(r.json()["id"])

        async def probe() -> dict:
            r = await stack.client.post("/v1/jobs", json={**body, "max_tokens": 3}, headers=_h(B))
            job_id = r.json()["id"]
            async with asyncio.timeout(15):
                while True:
                    view = (await stack.client.get(f"/v1/jobs/{job_id}", headers=_h(B))).json()
                    if view["status"] == "succeeded":
                        return view
                    await asyncio.sleep(0.01)

        await probe()  # B's first job waits for a slot: from here on B is another owner here
        waits = [(await probe())["timings"]["queue_s"] for _ in range(3)]
        assert max(waits) < BATCH_JOB_S / 4, waits
        held = sum(1 for r in stack.worker.st.running.values() if r.claim.owner is not None)
        assert held >= slots - 2  # A still has the rest of the batch
        views = [(await stack.client.get(f"/v1/jobs/{j}", headers=_h(A))).json() for j in backlog]
        assert "failed" not in {v["status"] for v in views}


async def test_a_read_past_an_owners_cap_leaves_the_reserve_to_the_others(
    settings: Settings, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's job came lately; then one read takes A's jobs into an empty engine: A starts all
    but the owner reserve, the rest wait for A's cap to lift, and B's next job starts at once.
    Before, A took every slot (the cap needed two owners' jobs started here, and some of A's
    running), and once capped, A's claims waiting here counted as taking the reserve's slots,
    so the worker looked for no other owner's job until one of A's ended (the backlog test
    above failed so, one run in ten: a probe waited 2.3-2.7 s)."""
    slots, reserve = 8, 2
    keyed = Settings(
        **{**settings.model_dump(), "api_keys": [A, B], "max_batch": slots, "owner_reserve": 2}
    )
    async with running_stack(keyed, redis, step_ms=5) as stack:
        st = stack.worker.st

        async def run(key: str, max_tokens: int) -> str:
            body = {"model": "sim", "prompt": "the model", "max_tokens": max_tokens}
            r = await stack.client.post("/v1/jobs", json=body, headers=_h(key))
            assert r.status_code == 202, r.text
            return str(r.json()["id"])

        async def done(job_id: str, key: str) -> dict:
            async with asyncio.timeout(15):
                while True:
                    view = (await stack.client.get(f"/v1/jobs/{job_id}", headers=_h(key))).json()
                    if view["status"] == "succeeded":
                        return dict(view)
                    await asyncio.sleep(0.01)

        await done(await run(B, 3), B)  # B is another owner here from now on
        monkeypatch.setattr(type(st.lease), "held", lambda self: False)  # the claimer stops reading
        await asyncio.sleep(3 * keyed.heartbeat_s)
        backlog = [await run(A, 400) for _ in range(slots + 4)]  # 2 s each
        monkeypatch.undo()  # one read takes them: all A's, into an empty engine

        def held() -> int:
            return sum(1 for r in st.running.values() if r.end is None and r.spec.id in backlog)

        async with asyncio.timeout(10):
            while held() < slots - reserve:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert held() == slots - reserve, [c.owner for c in st.waiting]  # the reserve is left
        probe = await done(await run(B, 3), B)
        assert probe["timings"]["queue_s"] < BATCH_JOB_S / 4, probe["timings"]
        views = [(await stack.client.get(f"/v1/jobs/{j}", headers=_h(A))).json() for j in backlog]
        assert {v["status"] for v in views} <= {"queued", "running"}


async def test_batch_slots_refill_while_the_reserve_waits_for_interactive_work(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """With the batch slots full, the claimer waits on the interactive lanes alone (the reserve
    is theirs). Batch slots coming free meanwhile end that wait at once: they used to sit idle
    until the blocking read timed out (GENQ_CLAIM_BLOCK_MS, each round), so a backlog of tiny
    batch jobs drained at one batch per block (tiny jobs ran five times slower)."""
    slots, jobs = 8, 48
    blocking = Settings(
        **{
            **settings.model_dump(),
            "max_batch": slots,
            "interactive_reserve": 2,
            "claim_block_ms": 1000,
        }
    )
    async with running_stack(blocking, redis, step_ms=5) as stack:
        body = {"prompt": "is it good?", "max_tokens": 2, "priority": "batch"}
        t0 = time.monotonic()
        queued = await asyncio.gather(*(stack.submit(**body, seed=i) for i in range(jobs)))
        for job in queued:  # 8 rounds of 6: one blocking read each, before (7 s or more)
            await stack.wait_status(job["id"], "succeeded", timeout=15)
        assert time.monotonic() - t0 < 3.0


async def test_a_redis_that_refuses_client_commands_still_drains(settings: Settings) -> None:
    """Where an ACL (or a managed Redis) refuses CLIENT ID / UNBLOCK, a blocking claim read
    ends at its timeout as it used to: slower refills, never a claim loop that fails."""
    admin = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    user, password = f"noclient-{settings.key_prefix.strip(':')}", "pw-noclient"
    await admin.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-client"],
    )
    limited = aioredis.Redis.from_url(
        settings.redis_url, username=user, password=password, decode_responses=True
    )
    try:
        quick = Settings(
            **{
                **settings.model_dump(),
                "max_batch": 8,
                "interactive_reserve": 2,
                "claim_block_ms": 100,
            }
        )
        async with running_stack(quick, limited, step_ms=5) as stack:
            body = {"prompt": "is it good?", "max_tokens": 20, "priority": "batch"}
            queued = await asyncio.gather(*(stack.submit(**body, seed=i) for i in range(24)))
            for job in queued:
                await stack.wait_status(job["id"], "succeeded", timeout=15)
            assert stack.worker._claims._can_unblock is False
    finally:
        await limited.aclose()
        await admin.acl_deluser(user)
        await admin.aclose()
