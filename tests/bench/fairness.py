"""Benchmark of fairness between API keys on the CPU: `genq gateway` + `genq worker --engine sim`
+ Redis, token-fair scheduling (the default).

    python -m tests.bench.fairness [--backlog 10000] [--max-batch 64] [--step-ms 20]

1. Idle: key B's short interactive jobs one at a time, TTFT p50 (its own, from the record).
2. Key A queues `--backlog` jobs of long prompts (~1,000 tokens, 100 new tokens each); B
   sends the same short jobs meanwhile: TTFT p50 against idle (the issue's target: ≤ 2×).
3. Both backlogged (as many jobs each), A's jobs three times B's size: each key's share of the
   tokens generated over `--share-s` seconds (target 50 % ± 10 %); then with weights 3:1
   (target 75 % ± 10 %); and the tokens generated a second over the window, both keys'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from shared.records import owner_of
from tests.procs import Cluster, redis_server

A, B = "bench-key-a", "bench-key-b"
LONG = " ".join(["the model queue worker gateway stream batch cache prompt reply"] * 100)


def h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def job(http: httpx.AsyncClient, url: str, key: str, **body: Any) -> dict[str, Any]:
    r = await http.post(f"{url}/v1/jobs", json={"model": "sim", **body}, headers=h(key))
    r.raise_for_status()
    job_id = r.json()["id"]
    while True:
        view = (await http.get(f"{url}/v1/jobs/{job_id}", headers=h(key))).json()
        if view["status"] not in ("queued", "running"):
            return view
        await asyncio.sleep(0.01)


async def probe_ttft(http: httpx.AsyncClient, url: str, n: int) -> float:
    ttft = []
    for i in range(n):
        view = await job(http, url, B, prompt=f"quick {i}", max_tokens=8)
        ttft.append(view["timings"]["ttft_s"])
    return statistics.median(ttft) * 1000


async def flood(http: httpx.AsyncClient, url: str, key: str, n: int, **body: Any) -> None:
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with sem:
            r = await http.post(
                f"{url}/v1/jobs",
                json={"model": "sim", "prompt": f"{body['prompt']} {i}", "seed": i, **body},
                headers=h(key),
            )
            r.raise_for_status()

    await asyncio.gather(*(one(i) for i in range(n)))


async def shares(redis_url: str, prefix: str, since: float, until: float) -> dict[str, Any]:
    """Each key's share of the tokens of the jobs that ended in [since, until], and how many of
    its jobs were still queued when read (a share means something only while both keys still
    had work queued: 0 left is a backlog that ran out inside the window)."""
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    tokens = {A: 0, B: 0}
    left = {A: 0, B: 0}
    try:
        owners = {owner_of(A.encode()): A, owner_of(B.encode()): B}
        async for key in r.scan_iter(match=f"{prefix}job:*", count=2000):
            rec = await r.hmget(key, "owner", "finished_at", "usage", "status")
            owner, finished, usage, status = rec
            if owner in owners and status == "queued":
                left[owners[owner]] += 1
            if owner in owners and finished and usage and since <= float(finished) <= until:
                tokens[owners[owner]] += json.loads(usage)["completion_tokens"]
    finally:
        await r.aclose()
    total = sum(tokens.values()) or 1
    rate = {"tokens_per_s": round(sum(tokens.values()) / (until - since), 1)}
    return {k: round(v / total, 3) for k, v in tokens.items()} | {"queued_left": left} | rate


async def scenario(url: str, redis_url: str, prefix: str, args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=600) as http:
        out["b_idle_ttft_ms_p50"] = round(await probe_ttft(http, url, args.probes), 1)
        t0 = time.monotonic()
        await flood(http, url, A, args.backlog, prompt=LONG, max_tokens=100)
        out["a_backlog_queued_s"] = round(time.monotonic() - t0, 1)
        out["b_backlog_ttft_ms_p50"] = round(await probe_ttft(http, url, args.probes), 1)
        out["ttft_ratio"] = round(out["b_backlog_ttft_ms_p50"] / out["b_idle_ttft_ms_p50"], 2)
        # both backlogged: B's jobs a third of A's size, as many (B's backlog must outlast
        # the window at three times A's weight: see queued_left)
        await flood(http, url, B, args.backlog, prompt="short", max_tokens=33)
        since = time.time()
        await asyncio.sleep(args.share_s)
        out["shares_both_backlogged"] = await shares(redis_url, prefix, since, time.time())
    return out


def run(args: argparse.Namespace, weights: dict[str, float] | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, redis_server() as server:
        prefix = f"bench:{uuid.uuid4().hex[:6]}:"
        cluster = Cluster(server.url, Path(tmp), prefix)
        try:
            env = {
                "GENQ_API_KEYS": f"{A},{B}",
                "GENQ_MAX_QUEUED_JOBS": "0",
                "GENQ_MAX_QUEUED_JOBS_PER_KEY": "0",
                "GENQ_PLACEMENT": "false",  # one worker: nothing to place
            }
            if weights:
                env["GENQ_KEY_WEIGHTS"] = json.dumps(weights)
            gw = cluster.gateway(**env)
            shape = ["--step-ms", str(args.step_ms), "--max-batch", str(args.max_batch)]
            cluster.worker(*shape, **env)  # waits for sim on /v1/models, with the first key
            return asyncio.run(scenario(gw.url, server.url, prefix, args))
        finally:
            cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backlog", type=int, default=10_000)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=20)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--share-s", type=float, default=60)
    args = ap.parse_args()
    result = {"equal_weights": run(args, None), "weights_b3_a1": run(args, {B: 3.0, A: 1.0})}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
