"""Benchmark: does a worker give back what its jobs took? Prints the worker's memory (RSS of the
worker process and of its engine process, if any) after a warm-up and after each round of
jobs of mixed sizes, streamed through a real gateway.

    python -m tests.bench.worker_memory                       # 10,000 jobs in 5 rounds
    python -m tests.bench.worker_memory --jobs 2000 --rounds 4 --concurrency 64

It starts its own redis-server, one `genq gateway` and one `genq worker` (sim engine,
--step-ms), and stops them at the end. The target: after every round the worker's RSS is
within 10 % of where it stood after the warm-up (what a job took is released when it ends).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import psutil

from genq.bench import Client, Target
from tests.procs import Cluster, redis_server

WORDS = "the of and to in is that for it as was with be by on not this are or from".split()
SIZES = ((16, 4), (64, 64), (512, 256), (2000, 1024), (4000, 2048))
"""(prompt words, max_tokens) of the mixed workload, drawn uniformly."""


def rss_mb(pid: int) -> float:
    """The process's RSS and its children's (the engine process), in MB."""
    return sum(rss_parts(pid).values())


def rss_parts(pid: int) -> dict[str, float]:
    """RSS in MB of the process and of each child, by a short name."""
    proc = psutil.Process(pid)
    parts = {"worker": proc.memory_info().rss / 1e6}
    for child in proc.children(recursive=True):
        try:
            name = "engine" if "engine_process" in " ".join(child.cmdline()) else child.name()
            parts[name] = parts.get(name, 0.0) + child.memory_info().rss / 1e6
        except psutil.Error:
            continue
    return parts


def shown(pid: int) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in rss_parts(pid).items())


def body(rng: random.Random, seed: int) -> bytes:
    words, max_tokens = rng.choice(SIZES)
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    job = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    return json.dumps(job | {"seed": seed}).encode()


async def run_round(url: str, jobs: int, concurrency: int, rng: random.Random) -> int:
    bodies = iter([body(rng, i) for i in range(jobs)])
    failed = 0

    async def loop() -> None:
        nonlocal failed
        client = Client(Target.from_url(url, None))
        for b in bodies:
            failed += not (await client.stream_job(b)).ok
        await client.close()

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=10_000, help="jobs in all (default 10,000)")
    p.add_argument("--rounds", type=int, default=5, help="rounds the jobs come in (default 5)")
    p.add_argument("--warmup", type=int, default=300, help="jobs before the baseline")
    p.add_argument("--concurrency", type=int, default=64, help="streams at once (default 64)")
    p.add_argument("--step-ms", type=float, default=1.0, help="sim decode step (default 1)")
    p.add_argument(
        "--settle-s",
        type=float,
        default=12.0,
        help="wait before each reading (default 12: past the worker's log repair window, "
        "GENQ_LOG_REPAIR_WINDOW_S, for which it keeps what it needs to rewrite a job's end)",
    )
    args = p.parse_args()
    rng = random.Random(0)
    with redis_server() as redis, tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(redis.url, Path(tmp), "genq-bench-mem:")
        try:
            gateway = cluster.gateway()
            worker = cluster.worker("--step-ms", str(args.step_ms))
            asyncio.run(run_round(gateway.url, args.warmup, args.concurrency, rng))
            time.sleep(args.settle_s)
            base = rss_mb(worker.proc.pid)
            print(f"after {args.warmup} warm-up jobs: RSS {base:.1f} MB ({shown(worker.proc.pid)})")
            per_round = args.jobs // args.rounds
            worst = 0.0
            for r in range(args.rounds):
                t0 = time.perf_counter()
                failed = asyncio.run(run_round(gateway.url, per_round, args.concurrency, rng))
                wall = time.perf_counter() - t0
                time.sleep(args.settle_s)
                now = rss_mb(worker.proc.pid)
                worst = max(worst, now / base - 1)
                growth = f"{now / base - 1:+.1%} of the baseline"
                print(
                    f"round {r + 1}: {per_round} jobs in {wall:.1f} s ({failed} failed), "
                    f"RSS {now:.1f} MB ({growth}; {shown(worker.proc.pid)})"
                )
            print(f"largest growth over the baseline: {worst:+.1%} (target: within 10 %)")
        finally:
            cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
