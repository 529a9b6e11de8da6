"""Scenario 6: a job that fails the engine on every attempt is dead-lettered after
`max_attempts` with an `error` event ending its stream; the jobs batched beside it go on."""

from __future__ import annotations

import asyncio

from tests.chaos.harness import Reference, Stream, follow, stream_faults
from tests.chaos.scenarios import Env, job_body

MARKER = "POISON"
HEALTHY = 10
MAX_TOKENS = 40
MAX_ATTEMPTS = 3
TIMEOUT_S = 30.0


async def test_poison_job_is_dead_lettered_and_its_batch_goes_on(env: Env) -> None:
    env.cluster.gateway()
    fault = {"GENQ_SIM_POISON_MARKER": MARKER, "GENQ_MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    for _ in range(2):
        env.worker("--step-ms", "50", **fault)
    await env.wait_workers(2)
    poison = Stream({**job_body(0, MAX_TOKENS), "prompt": f"the {MARKER} model"})
    healthy = [Stream(job_body(i, MAX_TOKENS)) for i in range(1, HEALTHY + 1)]
    streams = [*healthy[: HEALTHY // 2], poison, *healthy[HEALTHY // 2 :]]
    await asyncio.wait_for(
        asyncio.gather(*(follow(env.http, env.gateways, s) for s in streams)), TIMEOUT_S
    )

    final = poison.events[-1]
    assert final.type == "error" and final.data["code"] == "max_attempts_exceeded"
    assert "poison marker" in final.data["message"]
    assert [e.seq for e in poison.events] == list(range(1, len(poison.events) + 1))
    started = [e.data["attempt"] for e in poison.events if e.type == "started"]
    assert started == list(range(1, MAX_ATTEMPTS + 1))
    record = await env.record(poison.job_id or "")
    assert record["status"] == "failed" and record["attempt"] == str(MAX_ATTEMPTS)
    assert await env.dead_letters() == [poison.job_id]

    reference = Reference()
    for s in healthy:
        ref = reference.text(s.body["prompt"], s.body["seed"], MAX_TOKENS)
        assert not stream_faults(s, ref, MAX_TOKENS)
        assert (await env.record(s.job_id or ""))["attempt"] == "1"
    assert await env.pending() == 0
