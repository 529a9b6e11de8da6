"""Benchmark of the engine boundary alone: the worker's side of its engine (an engine process,
or the in-process thread) driving the sim engine at full speed, no Redis, no gateway. A closed
loop keeps `--concurrency` jobs in the engine, adding one as each ends, and drains outputs as
the flush loop does; prints tokens/s, the CPU each process used per token, and the steps.

    python -m tests.bench.engine_link --jobs 2048 --concurrency 256 --max-tokens 200
        [--in-process] [--detokenize worker] [--no-gc-in-steps]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from genq.procstats import cpu_seconds
from shared.schemas import Sampling
from shared.settings import Settings
from worker.engine import EngineJob
from worker.engine_client import EngineProcess
from worker.link import EngineLink
from worker.runner import EngineRunner
from worker.sim import SimEngine

PROMPT = [5, 6, 7] * 10


async def run(a: argparse.Namespace) -> dict:
    settings = Settings(
        sim_step_ms=0,
        sim_prefill_ms_per_1k=0,
        max_batch=a.concurrency,
        detokenize=a.detokenize,
        engine_gc_in_steps=not a.no_gc_in_steps,
    )
    link: EngineLink
    if a.in_process:
        engine = SimEngine(step_ms=0, prefill_ms_per_1k=0, max_batch=a.concurrency)
        link = EngineRunner(engine, detokenize=a.detokenize == "worker")
    else:
        link = await EngineProcess.spawn(settings)
    woken = asyncio.Event()
    link.start(asyncio.get_running_loop(), woken.set)
    added = done = tokens = 0

    def add() -> None:
        nonlocal added
        job = EngineJob(f"{added:032x}", PROMPT, a.max_tokens, Sampling(seed=added), added)
        link.add(job, 1)
        added += 1

    engine_pid = link.pid
    before = cpu_seconds(engine_pid) if engine_pid else 0.0
    here = time.process_time()
    t0 = time.perf_counter()
    for _ in range(min(a.concurrency, a.jobs)):
        add()
    while done < a.jobs:
        await woken.wait()
        woken.clear()
        for o in link.drain():
            tokens += len(o.token_ids)
            if o.finish_reason is not None:
                done += 1
                if added < a.jobs:
                    add()
    wall = time.perf_counter() - t0
    worker_cpu = time.process_time() - here
    engine_cpu = cpu_seconds(engine_pid) - before if engine_pid else None
    steps = link.times.steps
    await link.aclose()
    return {
        "mode": "in-process" if a.in_process else "engine process",
        "detokenize": a.detokenize,
        "gc_in_steps": not a.no_gc_in_steps,
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall),
        "worker_cpu_us_per_token": round(worker_cpu / tokens * 1e6, 3),
        "engine_cpu_us_per_token": round(engine_cpu / tokens * 1e6, 3) if engine_cpu else None,
        "steps": steps,
        "tokens_per_step": round(tokens / max(steps, 1), 1),
        "engine_step_us": round(link.times.engine_s / max(steps, 1) * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--detokenize", choices=["engine", "worker"], default="engine")
    ap.add_argument("--no-gc-in-steps", action="store_true")
    print(json.dumps(asyncio.run(run(ap.parse_args()))))


if __name__ == "__main__":
    main()
