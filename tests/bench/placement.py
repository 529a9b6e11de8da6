"""Benchmark of cache-aware placement: placement off against on, in one call, on a genq of
`genq gateway` + N `genq worker --engine sim` (each with its prefix cache; prefill charged per
uncached token) + Redis, or on a GPU with `genq serve --model DIR`.

    python -m tests.bench.placement [--workers 4] [--conversations 200] [--turns 5]
        [--concurrency 32] [--system-tokens 1000] [--turn-tokens 300] [--new-tokens N]
        [--shared-system] [--prefill-chunk TOKENS] [--unrelated]
    python -m tests.bench.placement --agent [--agent-workers 2,4] [--pause 0]
    python -m tests.bench.placement --model DIR --procs 1,2,3,4 [the workload's flags]

Conversations (the default): a ~1,000-token system prompt (each conversation's own, or with
`--shared-system` one for all, the conversation's name after it), then turns that each add
~300 tokens of history (the question and a reply of `--new-tokens`, default half the turn); a
turn's prompt is everything so far, so all of it but the new question is history some worker
prefilled before. Prints per mode: the share of history tokens served from a cache, TTFT
p50/p99 (the job's own, from its record), tokens/s of the whole run, jobs per worker and the
busiest's distance from the mean, the placement outcomes; and on/off ratios. `--unrelated`:
every job a new prompt (nothing to reuse), for the cost of placement and the balance of load.
`--prefill-chunk`: the sim prefills one job after another, that many tokens a step, each step
taking their prefill time (GENQ_SIM_PREFILL_CHUNK_TOKENS: the cost a GPU pays for recomputing
a prefix).

`--agent`: an agent's follow-up, sent the moment the last turn's answer arrives (`--pause`
seconds later): 8 conversations of a ~4,800-token prompt, then the same prompt and a few words,
on 2 and 4 sim workers at their defaults; prints the share of the second turn's prompt served
from cache. No `prompt_cache_key`: the prompt alone must find its worker.

`--model DIR` (a GPU host): the conversations on `genq serve --model DIR --procs-per-gpu N` for
each N of `--procs`, placement off and on for N > 1, on the Redis of GENQ_REDIS_URL (else a
private redis-server); every reply is `--new-tokens` long (min_tokens); `--model sim` tries the
harness on the CPU. E.g. the multi-turn table on an 8B synth model:

    python -m genq synth-model /tmp/m8b --shape 8b
    python -m tests.bench.placement --model /tmp/m8b --procs 1,2,3,4 --concurrency 64 \\
        --shared-system --new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import redis

from genq.stats import ms, percentile
from shared.keys import Keys
from tests.procs import Cluster, free_port, redis_server, wait_for

WORDS = (
    "the model queue worker gateway stream batch cache prompt reply event redis python "
    "system light river stone cloud green quiet morning garden window bridge paper music"
).split()
AGENT_CONVERSATIONS = 8
AGENT_TOKENS = 4800
READY_S = 900.0
"""How long a `genq serve --model` may take to load its processes."""


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def wait_job(http: httpx.AsyncClient, url: str, job_id: str) -> dict[str, Any]:
    while True:
        job: dict[str, Any] = (await http.get(f"{url}/v1/jobs/{job_id}")).json()
        if job["status"] not in ("queued", "running"):
            return job
        await asyncio.sleep(0.05)


async def conversation(
    http: httpx.AsyncClient,
    url: str,
    c: int,
    args: argparse.Namespace,
    out: list[dict[str, Any]],
) -> None:
    rng = random.Random(c)
    system = words(args.system_tokens, random.Random(-1) if args.shared_system else rng)
    name = f"conversation {c}:"
    history = f"{system}\n{name}" if args.shared_system else f"{name} {system}"
    new_tokens = args.new_tokens or args.turn_tokens // 2
    for turn in range(args.turns):
        question = words(args.turn_tokens - new_tokens, rng)
        prompt = history + " " + question
        body: dict[str, Any] = {
            "model": args.model_name,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "seed": c,
        }
        if args.model:
            body["min_tokens"] = new_tokens
        if not args.unrelated:
            body["metadata"] = {"prompt_cache_key": f"conv-{c}"}
        r = await http.post(f"{url}/v1/jobs", json=body)
        r.raise_for_status()
        job = await wait_job(http, url, r.json()["id"])
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
                "queue_s": job["timings"]["queue_s"],
            }
        )
        history = prompt + job["text"]
        if args.unrelated:
            history = f"conversation {c}-{turn}: " + words(args.system_tokens, rng)


async def workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as http:

        async def one(c: int) -> None:
            async with sem:
                await conversation(http, url, c, args, out)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(args.conversations)))
        wall = time.perf_counter() - t0
        metrics = (await http.get(f"{url}/metrics")).text
    history = sum(r["history"] for r in out)
    cached_history = sum(min(r["cached"], r["history"]) for r in out if r["turn"])
    ttft = [r["ttft_s"] for r in out if r["ttft_s"] is not None]
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
        "queue_ms_p50": ms(percentile([r["queue_s"] for r in out if r["queue_s"]], 50), 1),
        "ttft_ms_p50_by_turn": [
            ms(percentile([r["ttft_s"] for r in out if r["turn"] == t and r["ttft_s"]], 50), 1)
            for t in range(args.turns)
        ],
        "tokens_per_s": round(sum(r["completion"] for r in out) / wall, 1),
        "wall_s": round(wall, 2),
        "jobs_per_worker": sorted(per_worker.values()),
        "worst_worker_vs_mean": round(max(abs(v - mean) for v in per_worker.values()) / mean, 3),
        "placements": placements,
    }


def sim_workers(cluster: Cluster, args: argparse.Namespace, n: int, tuned: bool) -> None:
    """`n` sim workers: with the workload's settings (`tuned`), else the sim's defaults."""
    env = {}
    flags: list[str] = []
    if tuned:
        flags = ["--step-ms", str(args.step_ms), "--max-batch", str(args.max_batch)]
        env = {
            "GENQ_SIM_PREFILL_MS_PER_1K": str(args.prefill_ms_per_1k),
            "GENQ_SIM_CACHE_TOKENS": str(args.cache_tokens),
            "GENQ_SIM_PREFILL_CHUNK_TOKENS": str(args.prefill_chunk),
        }
    for _ in range(n):
        cluster.worker(*flags, **env)
    keys = Keys(cluster.env["GENQ_KEY_PREFIX"])
    client = redis.Redis.from_url(cluster.redis_url)
    wait_for(lambda: client.zcard(keys.workers()) >= n, timeout=120, what=f"{n} workers")


def run(args: argparse.Namespace, placement: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, redis_server() as server:
        cluster = Cluster(server.url, Path(tmp), f"bench:{uuid.uuid4().hex[:6]}:")
        try:
            gw = cluster.gateway(GENQ_PLACEMENT="true" if placement else "false")
            sim_workers(cluster, args, args.workers, tuned=True)
            return asyncio.run(workload(gw.url, args))
        finally:
            cluster.close()


# ---- the agent's follow-up ------------------------------------------------------------------


async def follow_ups(url: str, pause_s: float) -> dict[str, Any]:
    """Each conversation's second turn, sent `pause_s` after its first one's answer."""
    async with httpx.AsyncClient(timeout=120) as http:

        async def agent(c: int) -> tuple[int, int]:
            prompt = f"conversation {c}: " + words(AGENT_TOKENS, random.Random(c))
            body = {"model": "sim", "prompt": prompt, "max_tokens": 4}
            (await http.post(f"{url}/v1/completions", json=body)).raise_for_status()
            await asyncio.sleep(pause_s)
            body["prompt"] = prompt + " and then a few more words"
            second = await http.post(f"{url}/v1/completions", json=body)
            usage = second.raise_for_status().json()["usage"]
            return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

        turns = await asyncio.gather(*(agent(c) for c in range(AGENT_CONVERSATIONS)))
    return {
        "second_turn_cached_share": round(sum(c for c, _ in turns) / sum(p for _, p in turns), 3),
        "second_turns_cached": sum(1 for c, _ in turns if c),
    }


def run_agent(args: argparse.Namespace, workers: int, placement: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, redis_server() as server:
        cluster = Cluster(server.url, Path(tmp), f"bench:{uuid.uuid4().hex[:6]}:")
        try:
            gw = cluster.gateway(GENQ_PLACEMENT="true" if placement else "false")
            sim_workers(cluster, args, workers, tuned=False)
            return asyncio.run(follow_ups(gw.url, args.pause))
        finally:
            cluster.close()


# ---- a GPU: genq serve --model --------------------------------------------------------------


def run_serve(args: argparse.Namespace, procs: int, placement: bool) -> dict[str, Any]:
    """The conversations on `genq serve --model` with `procs` processes on the GPU, on the Redis
    of GENQ_REDIS_URL (a key prefix of their own), else on a private redis-server."""
    with contextlib.ExitStack() as stack:
        url = os.environ.get("GENQ_REDIS_URL") or stack.enter_context(redis_server()).url
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        prefix = f"bench:{uuid.uuid4().hex[:6]}:"
        cluster = Cluster(url, Path(tmp), prefix)
        port = free_port()
        engine = ["--engine", "sim"] if str(args.model) == "sim" else ["--model", str(args.model)]
        serve = ["serve", *engine, "--procs-per-gpu", str(procs), "--port", str(port)]
        proc = cluster._spawn("serve", serve, port, GENQ_PLACEMENT=str(placement).lower())
        keys = Keys(prefix)
        client = redis.Redis.from_url(url)
        try:

            def ready() -> bool:
                if proc.proc.poll() is not None:  # e.g. more processes than the GPU holds
                    raise RuntimeError(f"genq serve exited: {proc.output()[-800:]}")
                try:
                    models = httpx.get(f"{proc.url}/v1/models", timeout=2).json()["data"]
                except (httpx.HTTPError, ValueError, KeyError):
                    return False
                return bool(models) and client.zcard(keys.workers()) >= procs

            deadline = time.monotonic() + args.ready_s
            while not ready():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"genq serve not ready: {proc.output()[-800:]}")
                time.sleep(1.0)
            args.model_name = httpx.get(f"{proc.url}/v1/models").json()["data"][0]["id"]
            try:
                result = asyncio.run(workload(proc.url, args))
            except httpx.HTTPError as exc:  # what the service said, for the record
                raise RuntimeError(f"{exc}: {proc.output()[-3000:]}") from exc
            return {"procs": procs, "placement": placement, **result}
        finally:
            proc.stop(60)
            cluster.close()


def ratios(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        return round(on[key] / off[key], 3) if on[key] and off[key] else None

    return {k: ratio(k) for k in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99")}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=32, help="conversations at once")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--shared-system", action="store_true", help="one system prompt for all")
    ap.add_argument("--turn-tokens", type=int, default=300, help="question + reply per turn")
    ap.add_argument("--new-tokens", type=int, default=0, help="reply tokens (0: half a turn)")
    ap.add_argument("--step-ms", type=float, default=10)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--prefill-ms-per-1k", type=float, default=100, help="sim prefill cost")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="sim: prefill one at a time")
    ap.add_argument("--cache-tokens", type=int, default=400_000, help="each sim's prefix cache")
    ap.add_argument("--unrelated", action="store_true", help="every job a new prompt")
    ap.add_argument("--agent", action="store_true", help="the agent's follow-up at once")
    ap.add_argument("--agent-workers", default="2,4", help="sim workers of the agent runs")
    ap.add_argument("--pause", type=float, default=0.0, help="agent: seconds before turn 2")
    ap.add_argument("--model", type=Path, help="a model folder: genq serve on the GPU")
    ap.add_argument("--procs", default="1,2", help="--model: processes per GPU to run")
    ap.add_argument(
        "--placement-runs", default="off,on", help="--model: placement off, on or both (N > 1)"
    )
    ap.add_argument("--ready-s", type=float, default=READY_S, help="--model: load time allowed")
    args = ap.parse_args()
    args.model_name = "sim"
    args.placement = tuple(x == "on" for x in args.placement_runs.split(","))
    result: dict[str, Any] = {}
    if args.agent:
        for n in (int(x) for x in args.agent_workers.split(",")):
            for on in (False, True):
                result[f"{n}_workers_placement_{'on' if on else 'off'}"] = run_agent(args, n, on)
    elif args.model:
        for n in (int(x) for x in args.procs.split(",")):
            runs: dict[bool, dict[str, Any]] = {}
            for on in (True,) if n == 1 else args.placement:
                try:
                    runs[on] = run_serve(args, n, on)
                except (RuntimeError, TimeoutError) as exc:  # the next configuration still runs
                    runs[on] = {"procs": n, "placement": on, "error": str(exc)[-3000:]}
                result[f"{n}_procs_placement_{'on' if on else 'off'}"] = runs[on]
                print(json.dumps(runs[on]), flush=True)
            if len(runs) == 2 and not any("error" in r for r in runs.values()):
                result[f"{n}_procs_ratios_on_over_off"] = ratios(runs[True], runs[False])
    else:
        off, placed = run(args, False), run(args, True)
        result = {"placement_off": off, "placement_on": placed}
        result["ratios_on_over_off"] = ratios(placed, off)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
