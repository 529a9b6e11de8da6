"""Benchmark of cache-aware placement on the CPU: `genq gateway` + N `genq worker --engine sim`
(each with its prefix cache; prefill charged per uncached token) + Redis, placement on against
off in one call.

    python -m tests.bench.placement [--workers 4] [--conversations 200] [--turns 5]
        [--concurrency 32] [--system-tokens 1000] [--turn-tokens 300] [--unrelated]

A conversation is a ~1,000-token system prompt, then turns that each add ~300 tokens of
history (the reply and the next question); a turn's prompt is everything so far, so all of it
but the new question is history some worker prefilled before. Prints per mode: the share of
history tokens served from a cache, TTFT p50/p99 (the job's own, from its record), tokens/s of
the whole run, and jobs per worker. `--unrelated`: every job a new prompt (nothing to reuse),
for the cost of placement and the balance of load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from genq.stats import ms, percentile
from tests.procs import Cluster, redis_server

WORDS = (
    "the model queue worker gateway stream batch cache prompt reply event redis python "
    "system light river stone cloud green quiet morning garden window bridge paper music"
).split()


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(
    http: httpx.AsyncClient, url: str, c: int, args: argparse.Namespace, out: list[dict[str, Any]]
) -> None:
    rng = random.Random(c)
    history = f"conversation {c}: " + words(args.system_tokens, rng)
    for turn in range(args.turns):
        question = words(args.turn_tokens // 2, rng)
        prompt = history + " " + question
        body = {"model": "sim", "prompt": prompt, "max_tokens": args.turn_tokens // 2, "seed": c}
        if not args.unrelated:
            body["metadata"] = {"prompt_cache_key": f"conv-{c}"}
        r = await http.post(f"{url}/v1/jobs", json=body)
        r.raise_for_status()
        job_id = r.json()["id"]
        while True:
            job = (await http.get(f"{url}/v1/jobs/{job_id}")).json()
            if job["status"] not in ("queued", "running"):
                break
            await asyncio.sleep(0.05)
        new = len(question.split()) + 1
        out.append(
            {
                "turn": turn,
                "worker": job["worker"],
                "prompt": job["usage"]["prompt_tokens"],
                "history": max(0, job["usage"]["prompt_tokens"] - new) if turn else 0,
                "cached": job["usage"]["cached_tokens"],
                "completion": job["usage"]["completion_tokens"],
                "ttft_s": job["timings"]["ttft_s"],
            }
        )
        history = prompt + job["text"]
        if args.unrelated:
            history = f"conversation {c}-{turn}: " + words(args.system_tokens, rng)


async def workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=120) as http:

        async def one(c: int) -> None:
            async with sem:
                await conversation(http, url, c, args, out)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(args.conversations)))
        wall = time.perf_counter() - t0
        metrics = (await http.get(f"{url}/metrics")).text
    history = sum(r["history"] for r in out)
    cached_history = sum(min(r["cached"], r["history"]) for r in out if r["turn"])
    ttft = [r["ttft_s"] for r in out if r["turn"]]
    per_worker = Counter(r["worker"] for r in out)
    mean = len(out) / max(1, len(per_worker))
    placements = {
        line.split('"')[1]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("genq_placements_total{")
    }
    return {
        "jobs": len(out),
        "history_cached_share": round(cached_history / history, 3) if history else None,
        "cached_share_all_prompt": round(
            sum(r["cached"] for r in out) / sum(r["prompt"] for r in out), 3
        ),
        "ttft_ms_p50": ms(percentile(ttft, 50), 1),
        "ttft_ms_p99": ms(percentile(ttft, 99), 1),
        "tokens_per_s": round(sum(r["completion"] for r in out) / wall, 1),
        "wall_s": round(wall, 2),
        "jobs_per_worker": sorted(per_worker.values()),
        "worst_worker_vs_mean": round(max(abs(v - mean) for v in per_worker.values()) / mean, 3),
        "placements": placements,
    }


def run(args: argparse.Namespace, placement: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, redis_server() as server:
        cluster = Cluster(server.url, Path(tmp), f"bench:{uuid.uuid4().hex[:6]}:")
        try:
            env = {"GENQ_PLACEMENT": "true" if placement else "false"}
            gw = cluster.gateway(**env)
            for _ in range(args.workers):
                cluster.worker(
                    "--step-ms",
                    str(args.step_ms),
                    "--max-batch",
                    str(args.max_batch),
                    GENQ_SIM_PREFILL_MS_PER_1K=str(args.prefill_ms_per_1k),
                    GENQ_SIM_CACHE_TOKENS=str(args.cache_tokens),
                )
            return asyncio.run(workload(gw.url, args))
        finally:
            cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=32, help="conversations at once")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--turn-tokens", type=int, default=300, help="question + reply per turn")
    ap.add_argument("--step-ms", type=float, default=10)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--prefill-ms-per-1k", type=float, default=100, help="sim prefill cost")
    ap.add_argument("--cache-tokens", type=int, default=400_000, help="each sim's prefix cache")
    ap.add_argument("--unrelated", action="store_true", help="every job a new prompt")
    args = ap.parse_args()
    result = {"placement_off": run(args, False), "placement_on": run(args, True)}
    off, on = result["placement_off"], result["placement_on"]
    result["ratios_on_over_off"] = {
        "tokens_per_s": round(on["tokens_per_s"] / off["tokens_per_s"], 3),
        "ttft_p50": round(on["ttft_ms_p50"] / off["ttft_ms_p50"], 3)
        if off["ttft_ms_p50"]
        else None,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
