"""Scenario 3: SIGKILL the gateway clients are streaming from; each resumes on another gateway
with Last-Event-ID and gets the rest, exactly once."""

from __future__ import annotations

import asyncio

from tests.chaos.harness import Reference, Stream, follow, stream_faults, until
from tests.chaos.scenarios import Env, job_body

JOBS = 5
MAX_TOKENS = 60
TIMEOUT_S = 30.0


async def test_client_resumes_on_another_gateway(env: Env) -> None:
    first = env.cluster.gateway()
    env.cluster.gateway()
    env.worker("--step-ms", "50")
    streams = [Stream(job_body(i, MAX_TOKENS)) for i in range(JOBS)]
    # Every client starts on the first gateway; `gateways()` lists only live ones.
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def streaming() -> bool:
        return all(s.tokens() >= 5 for s in streams)

    await until(streaming, TIMEOUT_S, "every stream under way")
    first.kill()
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    reference = Reference()
    for s in streams:
        assert s.reconnects >= 1
        ref = reference.text(s.body["prompt"], s.body["seed"], MAX_TOKENS)
        assert not stream_faults(s, ref, MAX_TOKENS)
        record = await env.record(s.job_id or "")
        assert record["status"] == "succeeded" and record["attempt"] == "1"
