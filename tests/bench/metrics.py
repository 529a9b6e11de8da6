"""Benchmark of metrics: what a scrape costs a gateway holding many open SSE streams, and what
recording costs the worker per token.

Scrape: a real `genq gateway` (one process, or `--workers N` in multiprocess mode) on a
private redis-server, `--streams` jobs queued (no worker: they stay open) and one SSE stream
open on each, then `--scrapes` sequential GET /metrics: p50/p99 of their latency as the
client sees it, and the size of the answer.

Render: GatewayMetrics.render alone, in this process.

Recording: WorkerMetrics.output (one engine output of one token: a perf_counter, an
inter-token-latency observation, a counter increment) and WorkerMetrics.ended (a job's
histograms and counters), timed in a loop, and the cost of the plain loop subtracted.

    python -m tests.bench.metrics [--streams 1000] [--scrapes 200] [--gateway-workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.metrics import GatewayMetrics
from shared.schemas import JobSpec, Sampling
from shared.settings import Settings
from tests.procs import Cluster, redis_server
from worker.engine import StepOutput
from worker.jobstate import Claim, RunningJob
from worker.metrics import WorkerMetrics

OPEN_WITHIN_S = 120.0


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _open_streams(url: str, n: int) -> tuple[httpx.AsyncClient, list[asyncio.Task[None]]]:
    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=n + 16)
    client = httpx.AsyncClient(base_url=url, limits=limits, timeout=60)
    ids = []
    for i in range(n):
        body = {"model": "sim", "prompt": f"stream {i}", "max_tokens": 16}
        ids.append((await client.post("/v1/jobs", json=body)).json()["id"])
    opened = asyncio.Semaphore(0)

    async def follow(job_id: str) -> None:
        async with client.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            chunks = r.aiter_bytes()
            opened.release()
            async for _ in chunks:
                pass

    tasks = [asyncio.create_task(follow(i)) for i in ids]
    async with asyncio.timeout(OPEN_WITHIN_S):
        for _ in ids:
            await opened.acquire()
    return client, tasks


def _open_count(text: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith("genq_sse_streams_open "))
    return float(line.split()[1])


async def scrape_cost(a: argparse.Namespace, url: str) -> dict[str, float]:
    client, tasks = await _open_streams(url, a.streams)
    try:
        async with asyncio.timeout(OPEN_WITHIN_S):  # every stream has reached its route
            while _open_count((await client.get("/metrics")).text) < a.streams:
                await asyncio.sleep(0.2)
        times: dict[str, list[float]] = {"/metrics": [], "/healthz": []}
        size = 0
        async with httpx.AsyncClient(base_url=url, timeout=30) as scraper:
            for _ in range(a.scrapes):  # /healthz beside: what any request waits meanwhile
                for path, took in times.items():
                    started = time.perf_counter()
                    r = await scraper.get(path)
                    took.append(time.perf_counter() - started)
                    size = len(r.content) if path == "/metrics" else size
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
    return {
        "streams": a.streams,
        "gateway_processes": a.gateway_workers,
        "scrape_p50_ms": round(statistics.median(times["/metrics"]) * 1000, 2),
        "scrape_p99_ms": round(_quantile(times["/metrics"], 0.99) * 1000, 2),
        "healthz_p50_ms": round(statistics.median(times["/healthz"]) * 1000, 2),
        "healthz_p99_ms": round(_quantile(times["/healthz"], 0.99) * 1000, 2),
        "scrape_bytes": size,
    }


def recording_cost(n: int) -> dict[str, float]:
    metrics = WorkerMetrics("sim", "bench-worker", "0", 8192)
    spec = JobSpec(
        id="0" * 32,
        model="sim",
        input_ids=[1] * 32,
        max_tokens=n,
        sampling=Sampling(),
        priority="interactive",
        created_at=time.time(),
    )
    run = RunningJob(spec=spec, claim=Claim("0-1", "q", spec.id, 64), attempt=1, seq=0,
                     started_wall=time.time())  # fmt: skip
    run.first_token_wall = time.time()
    out = StepOutput(spec.id, token_ids=[7])

    def timed(body: object) -> float:
        started = time.perf_counter()
        for _ in range(n):
            body(run, out)  # type: ignore[operator]
        return (time.perf_counter() - started) / n

    empty = timed(lambda r, o: None)
    per_token = timed(metrics.output) - empty
    run.outcome, run.ended_wall = "length", time.time()
    per_job = timed(lambda r, o: metrics.ended(r)) - empty
    return {"per_token_ns": round(per_token * 1e9), "per_job_ns": round(per_job * 1e9)}


def render_cost(renders: int) -> dict[str, float]:
    """GatewayMetrics.render alone (one process), with a response series for every route
    template, method and a few statuses, 4 streams open."""
    metrics = GatewayMetrics(fleet_max_age_s=15.0)
    app = create_app(Settings(redis_url="redis://unused"))
    for route in app.openapi()["paths"]:
        for status in ("200", "404", "422"):
            metrics.responses.labels(route, "GET", status).inc()
    for _ in range(4):
        metrics.streams_open.inc()
    times = []
    for _ in range(renders):
        started = time.perf_counter()
        body = metrics.render()
        times.append(time.perf_counter() - started)
    return {
        "render_p50_us": round(statistics.median(times) * 1e6),
        "render_p99_us": round(_quantile(times, 0.99) * 1e6),
        "render_bytes": len(body),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--scrapes", type=int, default=200)
    p.add_argument("--gateway-workers", type=int, default=1)
    p.add_argument("--tokens", type=int, default=200_000, help="recordings timed")
    a = p.parse_args()
    print(json.dumps({"recording": recording_cost(a.tokens)}))
    print(json.dumps({"render": render_cost(a.scrapes)}))
    with redis_server() as redis, tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(redis.url, Path(tmp), "genqbench:", GENQ_QUEUE_MODELS='["sim"]')
        try:
            gw = cluster.gateway(processes=a.gateway_workers)
            # the model card, as a worker writes it, without a worker: the jobs stay queued
            cluster.worker("--step-ms", "1").stop()
            print(json.dumps({"scrape": asyncio.run(scrape_cost(a, gw.url))}))
        finally:
            for proc in reversed(cluster.procs):  # SIGTERM: uvicorn stops its children too
                proc.stop()
            cluster.close()


if __name__ == "__main__":
    main()
