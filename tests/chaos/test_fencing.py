"""Scenario 2: a worker paused past its lease (SIGSTOP) loses its jobs to another worker; when
it resumes (SIGCONT) it writes nothing more for them: no event, no result."""

from __future__ import annotations

import asyncio

from tests.chaos.harness import Reference, Stream, follow, stream_faults, until
from tests.chaos.scenarios import Env, job_body, sigcont, sigstop, worker_pid

JOBS = 8
MAX_TOKENS = 60
TIMEOUT_S = 30.0


async def test_worker_resumed_after_its_lease_writes_nothing(env: Env) -> None:
    env.cluster.gateway()
    stale = env.worker("--step-ms", "50")
    await env.wait_workers(1)
    streams = [Stream(job_body(i, MAX_TOKENS)) for i in range(JOBS)]
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def streaming() -> bool:
        return all(s.tokens() >= 3 for s in streams)

    await until(streaming, TIMEOUT_S, "every stream under way")
    ids = [s.job_id or "" for s in streams]
    stale_id = await env.owner(ids[0])
    assert stale_id is not None and worker_pid(stale_id) == stale.proc.pid
    sigstop(stale)
    fresh = env.worker("--step-ms", "50", wait_model=None)

    async def moved() -> bool:
        owners = [await env.owner(j) for j in ids]
        return all(worker_pid(o or "0-0-0") == fresh.proc.pid for o in owners)

    await until(moved, TIMEOUT_S, "the paused worker's jobs to move")
    sigcont(stale)

    # The resumed worker notices, at its first flush, that it lost the jobs.
    async def fenced() -> bool:
        return stale.output().count("lost ownership") >= 1

    await until(fenced, TIMEOUT_S, "the resumed worker to find itself fenced")
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    reference = Reference()
    for s, job_id in zip(streams, ids, strict=True):
        assert not stream_faults(
            s, reference.text(s.body["prompt"], s.body["seed"], MAX_TOKENS), MAX_TOKENS
        )
        log = await env.log(job_id)
        taken_over = next(
            i for i, e in enumerate(log) if e["type"] == "started" and e["attempt"] == 2
        )
        assert log[taken_over]["worker"] != stale_id
        assert all(e["attempt"] == 2 for e in log[taken_over:]), "the stale worker wrote an event"
        record = await env.record(job_id)
        assert record["status"] == "succeeded"
        assert record["worker"] != stale_id and record["attempt"] == "2"
    assert stale.proc.poll() is None, "the resumed worker should live on"
