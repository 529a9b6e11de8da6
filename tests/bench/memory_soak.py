"""Redis memory of finished jobs: bytes per job by length, and used_memory under a steady load.

    python -m tests.bench.memory_soak                       # this tree: sizes, then the soak
    python -m tests.bench.memory_soak --trees /work/main,.  # two trees side by side (before/after)

For each tree (`--trees`, comma-separated; its code runs the processes, by PYTHONPATH) it
starts a private redis-server (deploy/redis.conf, loopback only), one `genq gateway` and one
`genq worker` with the sim engine (--step-ms), with GENQ_RETENTION_S=--retention and
GENQ_EVENT_COMPACT_GRACE_S=--grace (a tree that has no compaction ignores it), then:

  sizes  one job of each --lengths tokens (at once): MEMORY USAGE (SAMPLES 0: every element)
         summed over the job's keys once it ended (its whole log) and, where the tree
         compacts, once its log was compacted; its text's bytes and the target (1.5 x + 1 KB);
         then a sizing table: what a fleet of --table-tokens-per-s holds in finished jobs of
         each length for each of --table-retentions, with --table-grace (on a tree without
         compaction, the grace changes nothing: both figures are the whole log's)
  soak   --duration seconds of --rate jobs/s (open loop, non-streaming submits, at most
         --max-in-flight awaiting their 202: past it a submit is shed and counted), a share
         --long-share of them --long-tokens long and the rest --short-tokens; used_memory
         every --sample-s, and at the end the mean of the last --retention seconds against
         the --retention seconds before them (1.00: a plateau)

Everything runs on loopback and stops at the end; the whole run is bounded by its arguments
(about sizes + duration + start-up, per tree).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from tests.procs import Cluster, redis_server

DEPLOY_REDIS_CONF = Path(__file__).resolve().parents[2] / "deploy" / "redis.conf"
PREFIX = "genq:"
POLL_S = 0.2
HTTP_TIMEOUT_S = 30.0
SIZES_TIMEOUT_S = 300.0
PROMPT = "tell me about the river and the stone"
COMPACT_INDEX = f"{PREFIX}compactdue"


async def job_bytes(r: aioredis.Redis, job_id: str) -> int:
    total = 0
    async for key in r.scan_iter(match=f"{PREFIX}*{{{job_id}}}*"):
        total += int(await r.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0"))
    return total


async def submit(http: httpx.AsyncClient, url: str, tokens: int) -> str:
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": tokens}
    r = await http.post(f"{url}/v1/jobs", json=body)
    r.raise_for_status()
    return str(r.json()["id"])


async def measured(r: aioredis.Redis, http: httpx.AsyncClient, url: str, tokens: int) -> dict:
    """One job of `tokens`: its bytes once it ended (with its whole log, while the grace
    lasts), and once its log was compacted where the tree compacts (a tree without compaction
    never lists a job to compact: both figures are then the same)."""
    job_id = await submit(http, url, tokens)
    deadline = time.monotonic() + SIZES_TIMEOUT_S
    whole: int | None = None
    while time.monotonic() < deadline:
        job = (await http.get(f"{url}/v1/jobs/{job_id}")).json()
        if job["status"] == "succeeded":
            if whole is None:
                events = await r.xlen(f"{PREFIX}events:{{{job_id}}}")
                whole = await job_bytes(r, job_id)
            if await r.zscore(COMPACT_INDEX, job_id) is None:
                used, text_bytes = await job_bytes(r, job_id), len(job["text"].encode())
                return {
                    "tokens": tokens,
                    "events": events,
                    "whole_log_bytes": whole,
                    "job_bytes": used,
                    "text_bytes": text_bytes,
                    "target": int(1.5 * text_bytes + 1024),
                    "compacted": bool(await r.hexists(f"{PREFIX}job:{{{job_id}}}", "log")),
                }
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"job {job_id} did not settle")


def sizing(rows: list[dict], a: argparse.Namespace) -> list[str]:
    """Memory a fleet's finished jobs hold: jobs/s x (grace x whole + (retention - grace) x
    compacted) bytes, for each job length measured."""
    out = []
    for row in rows:
        for retention in a.table_retentions:
            grace = min(a.table_grace, retention)
            per_job = grace * row["whole_log_bytes"] + (retention - grace) * row["job_bytes"]
            gb = a.table_tokens_per_s / row["tokens"] * per_job / 1e9
            out.append(
                f"  {a.table_tokens_per_s:,} tokens/s of {row['tokens']}-token jobs, retention "
                f"{retention:,} s, grace {grace} s: {gb:,.2f} GB"
            )
    return out


async def sizes(r: aioredis.Redis, http: httpx.AsyncClient, url: str, lengths: list[int]) -> list:
    return list(await asyncio.gather(*(measured(r, http, url, n) for n in lengths)))


async def soak(r: aioredis.Redis, http: httpx.AsyncClient, url: str, a: argparse.Namespace) -> dict:
    samples: list[tuple[float, int, int]] = []
    sent = failed = shed = 0
    t0 = time.monotonic()
    tasks: set[asyncio.Task[str]] = set()
    lengths = itertools.cycle(
        [a.long_tokens] * round(a.long_share * 100)
        + [a.short_tokens] * round((1 - a.long_share) * 100)
    )

    async def sample() -> None:
        while True:
            info = await r.info("memory")
            samples.append((time.monotonic() - t0, int(info["used_memory"]), await r.dbsize()))
            print(
                f"  t={samples[-1][0]:6.1f}s used_memory={samples[-1][1] / 2**20:8.2f} MiB "
                f"keys={samples[-1][2]} sent={sent} failed={failed} shed={shed}",
                flush=True,
            )
            await asyncio.sleep(a.sample_s)

    def done(t: asyncio.Task[str]) -> None:
        nonlocal failed
        tasks.discard(t)
        if t.cancelled() or t.exception() is not None:
            failed += 1

    sampler = asyncio.create_task(sample())
    while (elapsed := time.monotonic() - t0) < a.duration:
        due = int(elapsed * a.rate)
        while sent + shed < due:
            if len(tasks) >= a.max_in_flight:  # the box can't keep up: shed, and say so
                shed += 1
                continue
            t = asyncio.create_task(submit(http, url, next(lengths)))
            t.add_done_callback(done)
            tasks.add(t)
            sent += 1
        await asyncio.sleep(1 / a.rate)
    sampler.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    last = [m for t, m, _ in samples if t >= a.duration - a.retention]
    before = [
        m for t, m, _ in samples if a.duration - 2 * a.retention <= t < a.duration - a.retention
    ]
    mean_last = statistics.fmean(last) if last else 0.0
    mean_before = statistics.fmean(before) if before else 0.0
    return {
        "jobs_sent": sent,
        "jobs_failed": failed,
        "jobs_shed": shed,
        "tokens_per_s": round(
            a.rate * (a.long_share * a.long_tokens + (1 - a.long_share) * a.short_tokens)
        ),
        "used_memory_start_mib": round(samples[0][1] / 2**20, 2) if samples else None,
        "used_memory_end_mib": round(samples[-1][1] / 2**20, 2) if samples else None,
        "mean_last_window_mib": round(mean_last / 2**20, 2),
        "mean_window_before_mib": round(mean_before / 2**20, 2),
        "last_over_before": round(mean_last / mean_before, 3) if mean_before else None,
    }


async def run_tree(tree: str, a: argparse.Namespace) -> dict[str, Any]:
    env = {
        "PYTHONPATH": tree,
        "GENQ_RETENTION_S": str(a.retention),
        "GENQ_EVENT_COMPACT_GRACE_S": str(a.grace),
    }
    out: dict[str, Any] = {"tree": tree}
    here = os.getcwd()
    os.chdir(tree)  # `python -m genq` imports from its working directory first
    with tempfile.TemporaryDirectory() as tmp, redis_server(DEPLOY_REDIS_CONF) as server:
        cluster = Cluster(server.url, Path(tmp), PREFIX, **env)
        r = aioredis.Redis.from_url(server.url, decode_responses=True)
        try:
            gw = cluster.gateway()
            cluster.worker("--step-ms", str(a.step_ms), "--max-batch", str(a.max_batch))
            limits = httpx.Limits(max_connections=a.max_in_flight)
            timeout = httpx.Timeout(HTTP_TIMEOUT_S)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
                if "sizes" in a.sections:
                    out["sizes"] = await sizes(r, http, gw.url, a.lengths)
                    print(f"sizes ({out['tree']}):", flush=True)
                    for row in out["sizes"]:
                        print(f"  {row}", flush=True)
                    print("\n".join(sizing(out["sizes"], a)), flush=True)
                if "soak" in a.sections:
                    print(f"soak ({out['tree']}):", flush=True)
                    out["soak"] = await soak(r, http, gw.url, a)
                    print(f"  {out['soak']}", flush=True)
        finally:
            await r.aclose()
            cluster.close()
            os.chdir(here)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trees", default=".", help="comma-separated source trees to run")
    ap.add_argument("--sections", default="sizes,soak")
    ap.add_argument(
        "--lengths", default="64,256,1000,4000", type=lambda s: [int(x) for x in s.split(",")]
    )
    ap.add_argument("--retention", type=int, default=60, help="GENQ_RETENTION_S, seconds")
    ap.add_argument("--grace", type=int, default=5, help="GENQ_EVENT_COMPACT_GRACE_S, seconds")
    ap.add_argument("--duration", type=float, default=180.0, help="soak seconds")
    ap.add_argument("--rate", type=float, default=10.0, help="soak jobs per second")
    ap.add_argument("--long-share", type=float, default=0.2)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--table-tokens-per-s", type=int, default=7800, help="sizing: a fleet's rate")
    ap.add_argument(
        "--table-retentions",
        default="3600,86400",
        type=lambda s: [int(x) for x in s.split(",")],
        help="sizing: GENQ_RETENTION_S values",
    )
    ap.add_argument(
        "--table-grace", type=int, default=300, help="sizing: GENQ_EVENT_COMPACT_GRACE_S"
    )
    ap.add_argument(
        "--max-in-flight", type=int, default=64, help="submits awaiting an answer; more are shed"
    )
    ap.add_argument("--step-ms", type=float, default=5.0, help="the sim engine's step")
    ap.add_argument("--max-batch", type=int, default=256)
    a = ap.parse_args()
    for tree in a.trees.split(","):
        print(asyncio.run(run_tree(str(Path(tree).resolve()), a)), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
