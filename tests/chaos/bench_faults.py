"""Ordinary Redis trouble and worker faults, measured: each scenario `--reps` times
on a private redis-server with real genq processes, printing what the tests assert on.

    python -m tests.chaos.bench_faults --reps 5 [--only restarts,oom,deadline,cancel]

restarts   40 streams, 8 quick redis-server restarts (SIGKILL + start): jobs re-run, ended
           wrong (not succeeded), streams not exactly the reference.
noscript   40 streams while Redis forgets its scripts every 5 ms for 3 s (SCRIPT FLUSH: what
           a restart does to them, on every flush): the same figures.
oom        40 streams, Redis at maxmemory flickering 8 x 0.3 s: the same figures.
deadline   a 2 s job with no worker up, and a 3 s job whose worker is SIGKILLed: seconds from
           its deadline to `expired`.
cancel     a cancel right after the worker's control channel is killed: seconds to `cancelled`.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.chaos.harness import Reference, Stream, follow, quantile, stream_faults, until
from tests.chaos.scenarios import KEYS, Env, chaos_env, job_body, statuses

STREAMS = 40
TOKENS = 60
TIMEOUT_S = 60.0


async def _streams(env: Env) -> tuple[list[Stream], list[asyncio.Task[Stream]]]:
    env.cluster.gateway()
    for _ in range(2):
        env.worker("--step-ms", "30", "--max-batch", "32")
    await env.wait_workers(2)
    streams = [Stream(job_body(i, TOKENS)) for i in range(STREAMS)]
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def under_way() -> bool:
        return all(s.tokens() >= 3 for s in streams)

    await until(under_way, TIMEOUT_S, "the streams under way")
    return streams, tasks


async def _outcome(
    env: Env, streams: list[Stream], tasks: list[asyncio.Task[Stream]]
) -> dict[str, int]:
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    async def back() -> bool:
        return bool(await env.redis.ping())

    await until(back, TIMEOUT_S, "Redis")
    ref = Reference()
    ids = [s.job_id or "" for s in streams]
    wrong_text = sum(
        bool(stream_faults(s, ref.text(s.body["prompt"], s.body["seed"], TOKENS), TOKENS))
        for s in streams
    )
    st = await statuses(env, ids)
    attempts = Counter([await env.redis.hget(KEYS.job(j), "attempt") for j in ids])
    return {
        "jobs": len(ids),
        "rerun": sum(n for a, n in attempts.items() if a != "1"),
        "ended_wrong": len(ids) - st["succeeded"],
        "streams_wrong": wrong_text,
    }


async def restarts(env: Env) -> dict[str, float]:
    streams, tasks = await _streams(env)
    for _ in range(8):
        env.redis_server.kill()
        env.redis_server.start()
        await asyncio.sleep(0.4)
    return {**(await _outcome(env, streams, tasks))}


async def noscript(env: Env) -> dict[str, float]:
    streams, tasks = await _streams(env)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # what a quick restart does to the scripts
        await env.redis.script_flush()
        await asyncio.sleep(0.005)
    return {**(await _outcome(env, streams, tasks))}


async def oom(env: Env) -> dict[str, float]:
    streams, tasks = await _streams(env)
    for _ in range(8):
        used = int((await env.redis.info("memory"))["used_memory"])
        await env.redis.config_set("maxmemory", used - 1024)
        await asyncio.sleep(0.3)
        await env.redis.config_set("maxmemory", 0)
        await asyncio.sleep(0.3)
    return {**(await _outcome(env, streams, tasks))}


async def _submit(env: Env, url: str, **body: object) -> str:
    r = await env.http.post(f"{url}/v1/jobs", json={"model": "sim", "prompt": "x", **body})
    return str(r.json()["id"])


async def _until_status(env: Env, job: str, status: str) -> float:
    async def there() -> bool:
        return await env.redis.hget(KEYS.job(job), "status") == status

    await until(there, TIMEOUT_S, status, poll=0.01)
    return time.monotonic()


async def deadline(env: Env) -> dict[str, float]:
    gw = env.cluster.gateway()
    w = env.worker("--step-ms", "50")
    await env.wait_workers(1)
    t0 = time.monotonic()
    running = await _submit(env, gw.url, max_tokens=5000, timeout_s=3)
    await _until_status(env, running, "running")
    w.kill()
    dead_worker_s = await _until_status(env, running, "expired") - (t0 + 3)
    t1 = time.monotonic()
    queued = await _submit(env, gw.url, max_tokens=5, timeout_s=2)  # no worker is up now
    no_worker_s = await _until_status(env, queued, "expired") - (t1 + 2)
    return {"no_worker_s": round(no_worker_s, 3), "dead_worker_s": round(dead_worker_s, 3)}


async def cancel(env: Env) -> dict[str, float]:
    gw = env.cluster.gateway()
    env.worker("--step-ms", "20")
    await env.wait_workers(1)
    job = await _submit(env, gw.url, max_tokens=5000)
    await _until_status(env, job, "running")
    await env.redis.client_kill_filter(_type="pubsub")
    t0 = time.monotonic()
    await env.http.delete(f"{gw.url}/v1/jobs/{job}")
    return {"cancel_s": round(await _until_status(env, job, "cancelled") - t0, 3)}


SCENARIOS = {
    "restarts": restarts,
    "noscript": noscript,
    "oom": oom,
    "deadline": deadline,
    "cancel": cancel,
}


async def run(args: argparse.Namespace) -> None:
    for name in args.only.split(","):
        rows: list[dict[str, float]] = []
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp:
                async with chaos_env(Path(tmp)) as env:
                    rows.append(await SCENARIOS[name](env))
            print(f"{name}: {rows[-1]}", flush=True)
        keys = rows[0].keys()
        summary = {
            k: (
                sum(r[k] for r in rows)
                if k in ("jobs", "rerun", "ended_wrong", "streams_wrong")
                else f"p50 {quantile([r[k] for r in rows], 0.5)} max {max(r[k] for r in rows)}"
            )
            for k in keys
        }
        print(f"== {name} x {args.reps}: {summary}", flush=True)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", default=",".join(SCENARIOS))
    asyncio.run(run(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
