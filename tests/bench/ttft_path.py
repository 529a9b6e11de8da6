"""Where one stream's time to first token goes: a gateway and a worker (the sim engine, a
decode step of `--step-ms`) as separate processes on the Redis of GENQ_REDIS_URL, one client
sending `--requests` streamed jobs one after another, and each job's record (the gateway's
`created_at`, the worker's `started_at`, its first token) against the client's clock. All
on one host, so the wall clocks agree.

    python -m tests.bench.ttft_path [--requests 100] [--step-ms 10]

Segments (median, p90, min over the requests, ms):
- send → created: the client's request reaching the gateway, parsed, checked, its spec made
- created → started: subscribe, SUBMIT, the worker's blocked read waking, its claim
- started → first token (worker): START, the add to the engine process, the engine's first
  step (one `--step-ms` of it), the step's outputs back to the worker
- first token: worker → client: the flush, pub/sub, SSE
The GPU benchmark's TTFT overhead at one stream (`genq.benchgpu --compare`) is this path less
the engine's own step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from genq.benchgpu import SIM, System
from genq.stats import percentile

SEGMENTS = (
    "send → created",
    "created → started",
    "started → first token (worker)",
    "first token: worker → client",
    "total",
)
PROMPT = list(range(300, 332))


async def one(client: httpx.AsyncClient, url: str, seed: int) -> tuple[float, float, str]:
    """(send, first token, job id) of one streamed job, on the wall clock."""
    body = {"model": SIM, "input_ids": PROMPT, "max_tokens": 4, "stream": True, "seed": seed}
    sent = time.time()
    first = 0.0
    async with client.stream("POST", f"{url}/v1/jobs", json=body) as r:
        r.raise_for_status()
        job_id = r.headers["x-job-id"]
        async for line in r.aiter_lines():
            if not first and line.startswith("data:"):
                event = json.loads(line[5:])
                if event.get("token_ids") or event.get("text"):
                    first = time.time()
    return sent, first, job_id


async def measure(system: System, requests: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in SEGMENTS}
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(requests + 1):
            sent, first, job_id = await one(client, system.url, i)
            if i == 0:
                continue  # the first opens the connection and warms the caches
            rec = system.redis.hgetall(system.keys.job(job_id))
            created = json.loads(rec["spec"])["created_at"]
            started = float(rec["started_at"])
            worker_first = created + json.loads(rec["timings"])["ttft_s"]
            for k, v in zip(
                SEGMENTS,
                (
                    created - sent,
                    started - created,
                    worker_first - started,
                    first - worker_first,
                    first - sent,
                ),
                strict=True,
            ):
                out[k].append(v * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.ttft_path", description=__doc__)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=10.0, help="the sim engine's decode step")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="genq-ttft-path-"))
    env = {"GENQ_SIM_PREFILL_MS_PER_1K": "0"}
    system = System(Path(SIM), ["--step-ms", str(a.step_ms)], 1, logs, env)
    try:
        system.wait_ready()
        segs = asyncio.run(measure(system, a.requests))
    finally:
        system.close()
    rows = {
        k: {
            "p50": round(statistics.median(v), 2),
            "p90": round(percentile(v, 90) or 0.0, 2),
            "min": round(min(v), 2),
        }
        for k, v in segs.items()
    }
    overhead = round(rows["total"]["p50"] - a.step_ms, 2)
    if a.json:
        print(
            json.dumps(
                {
                    "step_ms": a.step_ms,
                    "requests": a.requests,
                    "segments_ms": rows,
                    "overhead_p50_ms": overhead,
                }
            )
        )
        return 0
    print(f"{a.requests} streamed jobs one after another, sim step {a.step_ms} ms (ms)")
    for k, r in rows.items():
        print(f"  {k:32} p50 {r['p50']:7.2f}  p90 {r['p90']:7.2f}  min {r['min']:7.2f}")
    print(f"  TTFT p50 less the engine's step: {overhead} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
