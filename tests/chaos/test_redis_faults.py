"""Ordinary Redis trouble that outlasts no lease: quick restarts (the scripts are forgotten,
NOSCRIPT) and a Redis at maxmemory flickering (OOM errors). Neither is an engine failure: no
job is re-run, none ends failed or cancelled, every stream is exact (issue 12, item 2)."""

from __future__ import annotations

import asyncio
import time

from tests.chaos.harness import Reference, Stream, follow, stream_faults, until
from tests.chaos.scenarios import KEYS, Env, job_body, statuses

STREAMS = 40
TOKENS = 60
TIMEOUT_S = 60.0
RESTARTS = 8
RESTART_GAP_S = 0.4
FLICKERS = 8
FLICKER_S = 0.3
OOM_HEADROOM_BYTES = 1024
SCRIPT_FLUSH_S = 3.0
SCRIPT_FLUSH_EVERY_S = 0.005


async def _streaming(env: Env, n: int) -> tuple[list[Stream], list[asyncio.Task[Stream]]]:
    streams = [Stream(job_body(i, TOKENS)) for i in range(n)]
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def under_way() -> bool:
        return all(s.tokens() >= 3 for s in streams)

    await until(under_way, TIMEOUT_S, "the streams under way")
    return streams, tasks


async def _all_exact(env: Env, streams: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    async def reconnected() -> bool:  # the test's own client lost its connections too
        return bool(await env.redis.ping())

    await until(reconnected, TIMEOUT_S, "the test's Redis client to reconnect")
    reference = Reference()
    faults = {
        s.job_id: f
        for s in streams
        if (f := stream_faults(s, reference.text(s.body["prompt"], s.body["seed"], TOKENS), TOKENS))
    }
    assert not faults, faults
    ids = [s.job_id for s in streams if s.job_id]
    assert (await statuses(env, ids))["succeeded"] == len(streams)
    attempts = {j: await env.redis.hget(KEYS.job(j), "attempt") for j in ids}
    assert set(attempts.values()) == {"1"}, {j: a for j, a in attempts.items() if a != "1"}
    assert await env.dead_letters() == []


async def test_quick_redis_restarts_rerun_no_job(env: Env) -> None:
    env.cluster.gateway()
    for _ in range(2):
        env.worker("--step-ms", "30", "--max-batch", "32")
    await env.wait_workers(2)
    streams, tasks = await _streaming(env, STREAMS)
    for _ in range(RESTARTS):
        env.redis_server.kill()
        env.redis_server.start()  # back within redis-py's retries: NOSCRIPT, not an outage
        await asyncio.sleep(RESTART_GAP_S)
    await _all_exact(env, streams, tasks)


async def test_redis_at_maxmemory_flickering_is_no_engine_failure(env: Env) -> None:
    env.cluster.gateway()
    for _ in range(2):
        env.worker("--step-ms", "30", "--max-batch", "32")
    await env.wait_workers(2)
    streams, tasks = await _streaming(env, STREAMS)
    started = time.monotonic()
    for _ in range(FLICKERS):
        used = int((await env.redis.info("memory"))["used_memory"])
        await env.redis.config_set("maxmemory", used - OOM_HEADROOM_BYTES)  # writes refused
        await asyncio.sleep(FLICKER_S)
        await env.redis.config_set("maxmemory", 0)
        await asyncio.sleep(FLICKER_S)
    assert time.monotonic() - started >= FLICKERS * 2 * FLICKER_S
    await _all_exact(env, streams, tasks)


async def test_scripts_forgotten_mid_flush_rerun_no_job(env: Env) -> None:
    """What a quick restart does to the scripts, without the restart's luck of timing: Redis
    forgets them (SCRIPT FLUSH) again and again while every worker flushes."""
    env.cluster.gateway()
    for _ in range(2):
        env.worker("--step-ms", "30", "--max-batch", "32")
    await env.wait_workers(2)
    streams, tasks = await _streaming(env, STREAMS)
    until_t = time.monotonic() + SCRIPT_FLUSH_S
    while time.monotonic() < until_t:
        await env.redis.script_flush()
        await asyncio.sleep(SCRIPT_FLUSH_EVERY_S)
    await _all_exact(env, streams, tasks)
