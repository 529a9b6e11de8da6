"""Benchmark: how fast one worker drains a backlog of tiny jobs (classification-style batches).

    python -m tests.bench.drain [--jobs 20000] [--max-tokens 4] [--step-ms 20] [--max-batch 256]
                                [--priority batch|interactive] [--api-key KEY]

It starts its own redis-server, one `genq gateway` and one `genq worker` (sim engine), stops
the worker (SIGSTOP), queues --jobs `batch`-priority (or --priority) jobs of --max-tokens new
tokens each through the gateway (keyed with --api-key, the jobs that key's), lets the worker go
on (SIGCONT) and follows it through its metrics port until every job has finished (the queue's
length in Redis, and the token-fair queue's). Prints jobs/s over the drain, the jobs in the
engine's batch (mean and peak of `genq_num_requests_running`, read once a
second), the worker's peak RSS
(worker and engine processes), and the ceiling the shape allows: max-batch jobs every
(max-tokens + 1) steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis

from shared.keys import Keys
from tests.bench.worker_memory import rss_parts
from tests.procs import Cluster, free_port, redis_server

METRICS_EVERY = 10
"""Polls (0.1 s apart) between two reads of the worker's /metrics."""


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
            total += float(line.split()[-1])
    return total


async def submit(args: argparse.Namespace, url: str) -> float:
    jobs: int = args.jobs
    concurrency: int = args.concurrency
    body = {"model": "sim", "prompt": "is this review positive?", "max_tokens": args.max_tokens}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    left = iter(range(jobs))
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=60, headers=headers) as http:

        async def one() -> None:
            for i in left:
                r = await http.post(
                    f"{url}/v1/jobs", json=body | {"priority": args.priority, "seed": i}
                )
                r.raise_for_status()

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return jobs / (time.perf_counter() - t0)


def drain(
    args: argparse.Namespace,
    worker_pid: int,
    metrics_url: str,
    queue: redis.Redis,
    key: str,
    fair_key: str,
) -> dict[str, Any]:
    """Follows the drain in Redis (a queue entry goes with its job's end) ten times a second,
    and the worker's /metrics once a second: a render costs the worker milliseconds."""
    running: list[float] = []
    peak_rss = 0.0
    peak_parts: dict[str, float] = {}
    t_first = t_last = None
    done = 0.0
    polls = 0
    deadline = time.monotonic() + args.timeout_s
    with httpx.Client(timeout=5) as http:
        while time.monotonic() < deadline:
            done = args.jobs - int(queue.xlen(key)) - int(queue.zcard(fair_key))
            now = time.perf_counter()
            if done and t_first is None:
                t_first = now
            polls += 1
            if t_first is not None and polls % METRICS_EVERY == 0:
                running.append(metric(http.get(metrics_url).text, "genq_num_requests_running"))
            parts = rss_parts(worker_pid)
            peak_rss = max(peak_rss, sum(parts.values()))
            for name, mb in parts.items():
                peak_parts[name] = max(peak_parts.get(name, 0.0), mb)
            if done >= args.jobs:
                t_last = now
                break
            time.sleep(0.1)
    if t_first is None or t_last is None:
        raise SystemExit(f"the backlog did not drain within {args.timeout_s} s ({done:.0f} done)")
    return {
        "jobs": args.jobs,
        "drain_s": round(t_last - t_first, 2),
        "jobs_per_s": round(args.jobs / (t_last - t_first), 1),
        "batch_mean": round(statistics.mean(running), 1) if running else None,
        "batch_peak": max(running) if running else None,
        "worker_peak_rss_mb": round(peak_rss, 1),
        "peak_rss_mb_by_process": {k: round(v, 1) for k, v in peak_parts.items()},
        "ceiling_jobs_per_s": round(
            args.max_batch / ((args.max_tokens + 1) * args.step_ms / 1000), 1
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=20)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64, help="submitting clients")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--env", action="append", default=[], help="K=V for every process")
    ap.add_argument("--priority", choices=("batch", "interactive"), default="batch")
    ap.add_argument("--api-key", help="the gateway keyed (GENQ_API_KEYS), the jobs this key's")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, redis_server() as server:
        env = dict(kv.split("=", 1) for kv in args.env)
        if args.api_key:
            env["GENQ_API_KEYS"] = args.api_key
        cluster = Cluster(server.url, Path(tmp), f"bench:{uuid.uuid4().hex[:6]}:", **env)
        try:
            gw = cluster.gateway()
            port = free_port()
            worker = cluster.worker(
                "--step-ms",
                str(args.step_ms),
                "--max-batch",
                str(args.max_batch),
                GENQ_METRICS_PORT=str(port),
            )
            worker.signal(signal.SIGSTOP)
            try:
                submit_rate = asyncio.run(submit(args, gw.url))
            finally:
                worker.signal(signal.SIGCONT)
            queue = redis.Redis.from_url(server.url)
            keys = Keys(cluster.env["GENQ_KEY_PREFIX"])
            key, fair_key = keys.queue("sim", args.priority), keys.fair_queue("sim", args.priority)
            metrics_url = f"http://127.0.0.1:{port}/metrics"
            try:
                result = drain(args, worker.proc.pid, metrics_url, queue, key, fair_key)
            finally:
                queue.close()
            result["submitted_per_s"] = round(submit_rate, 1)
        finally:
            cluster.close()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
