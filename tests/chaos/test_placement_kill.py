"""Placement on, a worker SIGKILLed: the jobs placed in its lane (waiting there, or started)
all finish on the other worker, each exactly once with an undisturbed run's text."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx

from tests.chaos.harness import Reference, Stream, follow, stream_faults, until
from tests.chaos.scenarios import Env, statuses, worker_pid

PREFIXES = [
    " ".join([f"conversation {c} the model queue worker gateway stream"] * 60) for c in (0, 1)
]
PER_PREFIX = 10
MAX_TOKENS = 40


async def test_sigkill_a_worker_holding_placed_jobs(env: Env) -> None:
    gw = env.cluster.gateway(GENQ_PLACEMENT_WAIT_S="30", GENQ_PLACEMENT_REFRESH_S="0.1")
    workers = [env.worker("--step-ms", "40", "--max-batch", "4") for _ in range(2)]
    await env.wait_workers(2)
    async with httpx.AsyncClient(timeout=30) as http:  # one conversation's first turn each
        for i, prefix in enumerate(PREFIXES):
            r = await http.post(
                f"{gw.url}/v1/jobs",
                json={"model": "sim", "prompt": prefix, "max_tokens": 2, "seed": i},
            )
            assert r.status_code == 202
    await asyncio.sleep(2.5)  # both have ended, beaten and been read by placement
    bodies = [
        {"model": "sim", "prompt": f"{p} turn {i}", "seed": i, "max_tokens": MAX_TOKENS}
        for p in PREFIXES
        for i in range(PER_PREFIX)
    ]
    streams = [Stream(b) for b in bodies]
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def some_running() -> bool:
        return sum(s.tokens() >= 2 for s in streams) >= 4

    await until(some_running, 30, "jobs to run")
    owners = Counter([await env.owner(s.job_id or "") for s in streams if s.tokens()])
    victim_id = owners.most_common(1)[0][0]
    victim = next(w for w in workers if w.proc.pid == worker_pid(victim_id or "0-0-0"))
    victim.kill()
    killed_at = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    reference = Reference()
    for s in streams:
        ref = reference.text(s.body["prompt"], s.body["seed"], MAX_TOKENS)
        assert stream_faults(s, ref, MAX_TOKENS) == [], s.job_id
    assert await statuses(env, [s.job_id or "" for s in streams]) == {"succeeded": len(streams)}
    # everything went on well before the 30 s steal deadline: a dead worker's lane is emptied
    assert time.monotonic() - killed_at < 25
    metrics = (await env.http.get(f"{gw.url}/metrics")).text
    placed = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('genq_placements_total{outcome="prefix"}')
    )
    # a worker of 4 slots is placed at most 4 jobs ahead (GENQ_PLACEMENT_MAX_LOAD): the rest of
    # its conversations' turns went to the shared queue
    assert placed >= 4, [x for x in metrics.splitlines() if "placement" in x]
