"""A worker's drain hands its running jobs back one by one; a job the flush loop finishes
while an earlier one is being handed back is gone from the running jobs by its turn. The old
drain asserted it was still there: the AssertionError ended the drain, and the jobs after it
were left to the reclaim loop (a lease later) instead of handed back at once."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

import worker.drain
from shared.settings import Settings
from tests.conftest import running_stack
from worker.entries import hand_back
from worker.state import WorkerState

JOBS = 3
SLOW_STEP_MS = 50.0
WAIT_S = 10.0


async def test_a_job_that_ends_during_the_drain_does_not_stop_the_others_hand_back(
    settings: Settings, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_stack(settings, redis, step_ms=SLOW_STEP_MS) as s:
        ids = [(await s.submit(prompt=f"p{i}", max_tokens=4000))["id"] for i in range(JOBS)]
        for job_id in ids:
            await s.wait_status(job_id, "running", timeout=WAIT_S)
        handed: list[str] = []
        order = list(s.worker.st.running)  # the drain's order: as the jobs started

        async def first_hand_back_meets_a_finish(st: WorkerState, run, **kw: object) -> None:  # type: ignore[no-untyped-def]
            if not handed:  # while this one goes back, the flush loop ends the next job
                st.drop(order[1])
            handed.append(run.id)
            await hand_back(st, run, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(worker.drain, "hand_back", first_hand_back_meets_a_finish)
        await asyncio.wait_for(worker.drain.drain(s.worker.st, 0.0), WAIT_S)
        assert handed == [order[0], order[2]]  # the old drain: AssertionError after the first
