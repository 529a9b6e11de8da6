"""Redis Sentinel failover, measured: the chaos scenario with and without WAIT, and WAIT's
cost per submit.

    python -m tests.chaos.bench_sentinel --reps 3 [--queued 200 --streams 50 --latency-n 300
        --stall-ms 150 --wait-timeout-ms 500]

Each repetition starts a master, a replica and three sentinels (tests/chaos/sentinels.py), a
`genq gateway` and two sim workers that find Redis through the sentinels, then SIGKILLs the
master under load (tests/chaos/sentinel_scenario.py), once with GENQ_REDIS_WAIT_REPLICAS=1
and once with 0; twice each: the replica in sync at the kill, and cut off `--stall-ms`
before it (the window asynchronous replication leaves). Recovery: SIGKILL → the sentinels
name the new master; → the first 2xx of a submit sent after the kill; → the last
interrupted stream going on. Lost: jobs answered 2xx
that the new master does not know. Then the latency of sequential submits (POST /v1/jobs,
one client) on an undisturbed group, WAIT on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import httpx

from tests.chaos.harness import quantile, submit
from tests.chaos.sentinel_scenario import FailoverResult, failover, sentinel_cluster
from tests.chaos.sentinels import sentinel_group


async def failovers(args: argparse.Namespace) -> dict[tuple[int, int], list[FailoverResult]]:
    out: dict[tuple[int, int], list[FailoverResult]] = {
        (w, s): [] for w in (1, 0) for s in (0, args.stall_ms)
    }
    for rep in range(1, args.reps + 1):
        for (wait, stall), rs in out.items():
            with sentinel_group() as group, tempfile.TemporaryDirectory() as tmp:
                r = await failover(
                    group,
                    Path(tmp),
                    wait_replicas=wait,
                    queued=args.queued,
                    streams=args.streams,
                    stall_ms=stall,
                    wait_timeout_ms=args.wait_timeout_ms,
                )
            rs.append(r)
            print(
                f"rep {rep} WAIT {wait} cut {stall} ms: accepted {r.accepted} "
                f"completed {r.completed} "
                f"lost {len(r.lost)} stuck {len(r.stuck)} bad streams {len(r.stream_faults)}  "
                f"failover {r.failover_s:.2f} s  submit back {_s(r.submit_recovery_s)}  "
                f"streams back {_s(r.stream_recovery_s)} ({r.streams_across_kill} across)  "
                f"lag at kill <= {r.repl_lag_bytes} B",
                flush=True,
            )
    return out


async def submit_latency(wait: int, n: int) -> list[float]:
    """Seconds per sequential submit through one gateway, WAIT for `wait` replicas."""
    env = {"GENQ_REDIS_WAIT_REPLICAS": str(wait)}
    with (
        sentinel_group() as group,
        tempfile.TemporaryDirectory() as tmp,
        sentinel_cluster(group, Path(tmp), **env) as cluster,
    ):
        gateway = cluster.gateway()
        cluster.worker("--step-ms", "1")
        body = {"model": "sim", "prompt": "hello", "max_tokens": 1}
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(n // 10):  # warm: connections made, scripts loaded
                await submit(http, gateway.url, body)
            out = []
            for _ in range(n):
                t = time.perf_counter()
                await submit(http, gateway.url, body)
                out.append(time.perf_counter() - t)
    return out


def _s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} s"


def _ms(values: list[float], q: float) -> float:
    return round(quantile(values, q) * 1000, 2)


async def main(args: argparse.Namespace) -> None:
    results = await failovers(args)
    latency = {w: await submit_latency(w, args.latency_n) for w in (0, 1)}
    summary: dict[str, object] = {}
    for (wait, stall), rs in results.items():
        summary[f"wait_{wait}_cut_{stall}ms"] = {
            "reps": len(rs),
            "accepted": sum(r.accepted for r in rs),
            "completed": sum(r.completed for r in rs),
            "lost": sum(len(r.lost) for r in rs),
            "stuck": sum(len(r.stuck) for r in rs),
            "bad_streams": sum(len(r.stream_faults) for r in rs),
            "failover_s_max": round(max(r.failover_s or 0 for r in rs), 2),
            "submit_recovery_s_max": round(max(r.submit_recovery_s or 0 for r in rs), 2),
            "stream_recovery_s_max": round(max(r.stream_recovery_s or 0 for r in rs), 2),
            "repl_lag_bytes_max": max(r.repl_lag_bytes for r in rs),
        }
    for wait, xs in latency.items():
        summary[f"submit_ms_wait_{wait}"] = {"p50": _ms(xs, 0.5), "p99": _ms(xs, 0.99)}
    summary["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--queued", type=int, default=200)
    p.add_argument("--streams", type=int, default=50)
    p.add_argument("--latency-n", type=int, default=300)
    p.add_argument("--stall-ms", type=int, default=150)
    p.add_argument("--wait-timeout-ms", type=int, default=500)
    asyncio.run(main(p.parse_args()))
