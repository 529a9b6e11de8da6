"""Scenario 1: SIGKILL a worker in the middle of 50 streams; every client's stream pauses and
goes on with exactly the text of an undisturbed run."""

from __future__ import annotations

from tests.chaos.harness import FAST_LEASES
from tests.chaos.scenarios import KEYS, Env, statuses, worker_kill

LEASE_S = float(FAST_LEASES["GENQ_LEASE_S"])
RECLAIM_BOUND_S = LEASE_S + 5  # the bound: lease + 5 s


async def test_sigkill_worker_mid_stream_loses_and_repeats_nothing(env: Env) -> None:
    result = await worker_kill(env, jobs=50, max_tokens=60, step_ms=50)

    assert result.moved >= 1, "the killed worker held no job"
    assert result.lost == 0 and result.duplicated == 0 and result.wrong == 0, result.faults
    assert len(result.recoveries) == result.moved
    assert max(result.recoveries) < RECLAIM_BOUND_S
    ids = await env.job_ids()
    assert len(ids) == 50
    assert await statuses(env, ids) == {"succeeded": 50}
    assert await env.pending() == 0
    assert await env.redis.xlen(KEYS.dead_letters()) == 0
