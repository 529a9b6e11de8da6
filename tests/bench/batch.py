"""Benchmark of batch mode (the Files and Batches API on the queue). Prints its figures.

    python -m tests.bench.batch                          # the CPU figures, sim engine, step 0
    python -m tests.bench.batch --url http://127.0.0.1:8000 --model NAME --sections compare \\
        --lines 2000 --max-tokens 128 --system-tokens 512            # a running genq (GPU)

Sections (`--sections`, comma-separated; default ingest,throughput,ttft):
  ingest      upload a file of --ingest-lines requests: lines/s checked and stored, and the
              Redis memory the stored file takes per line
  throughput  a batch of --lines requests (--max-tokens each), upload to completed: requests/s,
              tokens/s; gateway RSS and Redis memory sampled during it (peak, per line)
  ttft        interactive time to first token, p50/p99, as the client sees it and the
              worker's share (job created → started, → first token): idle, then beside a
              batch of --backlog-lines running with 10,000 of its jobs queued (and how many
              of its lines finished meanwhile, how many were still open after); the time to
              cancel such a backlog; and --load-requests interactive streams,
              --load-concurrency at once, beside another one (its lines done meanwhile)
  memory      (its own processes only) Redis memory per line of a batch of --lines: its input
              file; then queued, with the worker paused (and the rate lines are queued at);
              then done (the jobs' keys kept for GENQ_BATCH_JOB_RETENTION_S, and the output
              file); and one key of each kind
  compare     the same --lines requests as a batch and as live streams (interactive jobs,
              --live-concurrency at once): tokens/s each, with a shared system prompt of
              --system-tokens words and with a distinct one per line (prefix cache effect)

Without --url it starts its own redis-server (deploy/redis.conf), one `genq gateway` (two with
--split-gateways: interactive traffic then goes to one that runs no batch loops) and one
`genq worker` with the sim engine (--step-ms, --max-batch), and stops them at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis

from genq.bench import Client, Target
from genq.stats import percentile
from shared.batches import batch_job_id
from tests.procs import Cluster, Proc, redis_server

DEPLOY_REDIS_CONF = Path(__file__).resolve().parents[2] / "deploy" / "redis.conf"
WORDS = (
    "the of and to in is that for it as was with be by on not this are or from at queue "
    "worker model engine token batch river stone light answer window"
).split()
SAMPLE_S = 0.25
QUEUE_POLL_S = 0.01
PROBE_TOKENS = 4
QUESTION_WORDS = 24
BACKLOG_READY = 0.05
"""The ttft probes start once this share of the backlog batch is queued or done."""
HTTP_TIMEOUT_S = 600.0
PREFIX = "benchbatch:"
ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass
class Stack:
    url: str
    redis: aioredis.Redis | None
    http: httpx.AsyncClient
    worker: Proc | None = None
    """The worker, when this benchmark started it (the memory section pauses it)."""
    prefix: str = ""
    probe_url: str = ""
    """Where interactive probes and load go (a gateway without batch loops, with
    --split-gateways); else `url`."""

    @property
    def interactive(self) -> str:
        return self.probe_url or self.url


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def lines(n: int, model: str, max_tokens: int, system: str | int, seed: int = 0) -> list[dict]:
    """Completion requests: `system` (text) shared by all, or a distinct system prompt of
    `system` (int) words per line."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        head = system if isinstance(system, str) else _text(rng, system)
        body = {
            "model": model,
            "prompt": f"{head}\n{_text(rng, QUESTION_WORDS)}",
            "max_tokens": max_tokens,
            "seed": i,
        }
        out.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return out


def jsonl(requests: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in requests).encode()


async def upload(http: httpx.AsyncClient, url: str, content: bytes) -> dict:
    r = await http.post(
        f"{url}/v1/files", data={"purpose": "batch"}, files={"file": ("bench.jsonl", content)}
    )
    r.raise_for_status()
    return dict(r.json())


async def create(http: httpx.AsyncClient, url: str, file_id: str) -> dict:
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    r = await http.post(f"{url}/v1/batches", json=body)
    r.raise_for_status()
    return dict(r.json())


async def batch(http: httpx.AsyncClient, url: str, batch_id: str) -> dict:
    r = await http.get(f"{url}/v1/batches/{batch_id}")
    r.raise_for_status()
    return dict(r.json())


async def redis_mb(r: aioredis.Redis | None) -> float | None:
    if r is None:
        return None
    info = await r.info("memory")
    return round(int(info["used_memory"]) / 2**20, 1)


async def gateway_mb(http: httpx.AsyncClient, url: str) -> float | None:
    data = (await http.get(f"{url}/readyz")).json()
    return data.get("rss_mb")


# ---- sections -----------------------------------------------------------------------------


async def ingest(s: Stack, args: argparse.Namespace) -> dict[str, Any]:
    content = jsonl(lines(args.ingest_lines, args.model, args.max_tokens, _system(args)))
    before = await redis_mb(s.redis)
    t0 = time.perf_counter()
    f = await upload(s.http, s.url, content)
    took = time.perf_counter() - t0
    after = await redis_mb(s.redis)
    per_line = None
    if before is not None and after is not None:
        per_line = round((after - before) * 2**20 / args.ingest_lines)
    return {
        "ingest_lines": args.ingest_lines,
        "ingest_bytes": f["bytes"],
        "ingest_s": round(took, 2),
        "ingest_lines_per_s": round(args.ingest_lines / took),
        "ingest_redis_bytes_per_line": per_line,
    }


async def run_batch(s: Stack, requests: list[dict]) -> tuple[dict, float, dict[str, float]]:
    """Upload and run a batch to its end; (the batch, seconds from upload, peaks)."""
    peaks: dict[str, float] = {}
    base = await redis_mb(s.redis)
    t0 = time.perf_counter()
    f = await upload(s.http, s.url, jsonl(requests))
    b = await create(s.http, s.url, f["id"])
    while b["status"] not in ENDED:
        await asyncio.sleep(SAMPLE_S)
        b = await batch(s.http, s.url, b["id"])
        for name, value in (
            ("gateway_rss_mb", await gateway_mb(s.http, s.url)),
            ("redis_mb", await redis_mb(s.redis)),
        ):
            if value is not None:
                peaks[name] = max(peaks.get(name, 0.0), value)
    took = time.perf_counter() - t0
    if base is not None:
        peaks["redis_base_mb"] = base
    return b, took, peaks


async def throughput(s: Stack, args: argparse.Namespace) -> dict[str, Any]:
    requests = lines(args.lines, args.model, args.max_tokens, _system(args), seed=1)
    b, took, peaks = await run_batch(s, requests)
    out: dict[str, Any] = {
        "batch_lines": args.lines,
        "batch_status": b["status"],
        "batch_failed": b["request_counts"]["failed"],
        "batch_s": round(took, 2),
        "batch_requests_per_s": round(args.lines / took, 1),
        "batch_tokens_per_s": round(b["usage"]["output_tokens"] / took, 1),
        "gateway_peak_rss_mb": peaks.get("gateway_rss_mb"),
        "redis_peak_mb": peaks.get("redis_mb"),
    }
    if "redis_mb" in peaks and "redis_base_mb" in peaks:
        grown = (peaks["redis_mb"] - peaks["redis_base_mb"]) * 2**20
        out["redis_peak_bytes_per_line"] = round(grown / args.lines)
    if b["output_file_id"]:
        f = (await s.http.get(f"{s.url}/v1/files/{b['output_file_id']}")).json()
        out["output_bytes_per_line"] = round(f["bytes"] / max(1, b["request_counts"]["completed"]))
    return out


@dataclass
class Probes:
    ttft: list[float]
    """As the client saw it: request sent → first token event."""
    worker_queue: list[float]
    """From the job records: created → started by a worker."""
    worker_ttft: list[float]
    """From the job records: created → first token at the worker."""


async def probes(s: Stack, args: argparse.Namespace) -> Probes:
    """Sequential interactive streams (`POST /v1/jobs`); each one's time to first token,
    and the worker's side of it read back from the job."""
    rng = random.Random(7)
    out = Probes([], [], [])
    for i in range(args.probes):
        body = {
            "model": args.model,
            "prompt": _text(rng, QUESTION_WORDS),
            "max_tokens": PROBE_TOKENS,
            "seed": i,
            "stream": True,
        }
        t0 = time.perf_counter()
        first = None
        async with s.http.stream("POST", f"{s.interactive}/v1/jobs", json=body) as r:
            job_id = r.headers.get("x-job-id")
            async for line in r.aiter_lines():
                if first is None and line == "event: token":
                    first = time.perf_counter() - t0
        if first is None or job_id is None:
            continue
        out.ttft.append(first)
        timings = (await s.http.get(f"{s.interactive}/v1/jobs/{job_id}")).json()["timings"] or {}
        if timings.get("queue_s") is not None and timings.get("ttft_s") is not None:
            out.worker_queue.append(timings["queue_s"])
            out.worker_ttft.append(timings["ttft_s"])
    return out


async def _backlog(s: Stack, args: argparse.Namespace, seed: int) -> dict:
    """A batch of --backlog-lines requests, once a share of --lines is done: running, with
    GENQ_BATCH_MAX_IN_FLIGHT (10,000) of its jobs queued and the rest waiting in its file."""
    requests = lines(args.backlog_lines, args.model, args.max_tokens, _system(args), seed=seed)
    f = await upload(s.http, s.url, jsonl(requests))
    b = await create(s.http, s.url, f["id"])
    while True:
        b = await batch(s.http, s.url, b["id"])
        if _done(b) >= BACKLOG_READY * args.lines or b["status"] in ENDED:
            return b
        await asyncio.sleep(SAMPLE_S)


def _done(b: dict) -> int:
    return int(b["request_counts"]["completed"] + b["request_counts"]["failed"])


async def _cancel(s: Stack, b: dict) -> float:
    """Seconds from the cancel to the batch's end."""
    asked = time.perf_counter()
    await s.http.post(f"{s.url}/v1/batches/{b['id']}/cancel")
    while (b := await batch(s.http, s.url, b["id"]))["status"] not in ENDED:
        await asyncio.sleep(QUEUE_POLL_S)
    return time.perf_counter() - asked


async def ttft(s: Stack, args: argparse.Namespace) -> dict[str, Any]:
    idle = await probes(s, args)
    b = await _backlog(s, args, seed=2)
    before = _done(b)
    busy = await probes(s, args)
    b = await batch(s.http, s.url, b["id"])
    during_probes = _done(b) - before
    open_after_probes = args.backlog_lines - _done(b)
    await _cancel(s, b)
    b = await _backlog(s, args, seed=4)
    open_at_cancel = args.backlog_lines - _done(b)
    cancel_s = await _cancel(s, b)
    b = await _backlog(s, args, seed=3)
    before = _done(b)
    load = lines(args.load_requests, args.model, args.max_tokens, args.system_tokens, seed=8)
    tokens, load_s = await live(s, args, load, args.load_concurrency)
    b = await batch(s.http, s.url, b["id"])
    during_load = _done(b) - before
    await _cancel(s, b)
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    figures: dict[str, Any] = {"ttft_probes": len(idle.ttft)}
    for name, seen in (("idle", idle), ("backlog", busy)):
        for what, values in (
            ("ttft", seen.ttft),
            ("worker_queue", seen.worker_queue),
            ("worker_ttft", seen.worker_ttft),
        ):
            for q in (50, 99):
                figures[f"{what}_{name}_ms_p{q}"] = ms(percentile(values, q))
    return figures | {
        "backlog_lines_done_during_probes": during_probes,
        "backlog_open_lines_after_probes": open_after_probes,
        "cancel_open_lines": open_at_cancel,
        "cancel_s": round(cancel_s, 2),
        "load_streams": args.load_concurrency,
        "load_requests_per_s": round(args.load_requests / load_s, 1),
        "load_tokens_per_s": round(tokens / load_s, 1),
        "backlog_lines_done_during_load": during_load,
    }


async def _settled_mb(r: aioredis.Redis) -> float:
    """used_memory once lazily freed memory is back (what a batch holds, not its churn)."""
    await r.memory_purge()
    return (await redis_mb(r)) or 0.0


async def memory(s: Stack, args: argparse.Namespace) -> dict[str, Any]:
    if s.worker is None or s.redis is None:
        return {"memory": "needs its own processes (no --url)"}
    r = s.redis
    requests = lines(args.lines, args.model, args.max_tokens, _system(args), seed=6)
    base = await _settled_mb(r)
    f = await upload(s.http, s.url, jsonl(requests))
    stored = await _settled_mb(r)
    s.worker.signal(signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        b = await create(s.http, s.url, f["id"])
        queue = f"{s.prefix}queue:{args.model}:batch"
        while await r.xlen(queue) < args.lines:
            await asyncio.sleep(QUEUE_POLL_S)
        queue_s = time.perf_counter() - t0
        queued = await _settled_mb(r)
    finally:
        s.worker.signal(signal.SIGCONT)
    while (b := await batch(s.http, s.url, b["id"]))["status"] not in ENDED:
        await asyncio.sleep(SAMPLE_S)
    done = await _settled_mb(r)
    per = lambda a, z: round((z - a) * 2**20 / args.lines)  # noqa: E731
    out = {
        "memory_lines": args.lines,
        "queue_lines_per_s": round(args.lines / queue_s),
        "memory_input_file_bytes_per_line": per(base, stored),
        "memory_queued_job_bytes_per_line": per(stored, queued),
        "memory_done_bytes_per_line": per(stored, done),
    }
    job = batch_job_id(b["id"], 1)
    keys = {
        "job_record": f"{s.prefix}job:{{{job}}}",
        "job_events": f"{s.prefix}events:{{{job}}}",
        "line_claim": f"{s.prefix}batchline:{{{b['id']}}}:1",
        "output_file": f"{s.prefix}filedata:{{{b['output_file_id']}}}",
    }
    for name, key in keys.items():
        out[f"memory_key_{name}_bytes"] = await r.memory_usage(key)
    return out


async def live(
    s: Stack, args: argparse.Namespace, requests: list[dict], concurrency: int
) -> tuple[int, float]:
    """The requests as live interactive streams, `concurrency` at once; (tokens, seconds)."""
    u = urlsplit(s.interactive)
    target = Target(u.hostname or "127.0.0.1", u.port or 80, args.api_key)
    todo = iter(requests)
    tokens = 0

    async def loop() -> None:
        nonlocal tokens
        client = Client(target)
        for r in todo:
            res = await client.stream_job(json.dumps({**r["body"], "stream": True}).encode())
            tokens += res.tokens
        await client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0


async def compare(s: Stack, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"compare_lines": args.lines, "compare_max_tokens": args.max_tokens}
    shared = _text(random.Random(3), args.system_tokens)
    variants: tuple[tuple[str, str | int], ...] = (
        ("shared_prefix", shared),
        ("distinct_prefix", args.system_tokens),
    )
    for name, system in variants:
        requests = lines(args.lines, args.model, args.max_tokens, system, seed=4)
        b, took, _ = await run_batch(s, requests)
        out[f"{name}_batch_tokens_per_s"] = round(b["usage"]["output_tokens"] / took, 1)
        out[f"{name}_batch_cached_tokens"] = b["usage"]["input_tokens_details"]["cached_tokens"]
        tokens, took = await live(s, args, requests, args.live_concurrency)
        out[f"{name}_live_tokens_per_s"] = round(tokens / took, 1)
    return out


SECTIONS = {
    "ingest": ingest,
    "throughput": throughput,
    "ttft": ttft,
    "memory": memory,
    "compare": compare,
}


def _system(args: argparse.Namespace) -> str:
    return _text(random.Random(5), args.system_tokens)


@asynccontextmanager
async def stack(args: argparse.Namespace, tmp: Path) -> AsyncIterator[Stack]:
    timeout = httpx.Timeout(HTTP_TIMEOUT_S)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
        if args.url:
            r = aioredis.Redis.from_url(args.redis_url) if args.redis_url else None
            yield Stack(args.url, r, http)
            return
        with redis_server(DEPLOY_REDIS_CONF) as server:
            cluster = Cluster(server.url, tmp, PREFIX)
            r = aioredis.Redis.from_url(server.url)
            try:
                gw = cluster.gateway()
                probe = cluster.gateway(GENQ_BATCH_LOOPS="false") if args.split_gateways else gw
                worker = cluster.worker(
                    "--step-ms", str(args.step_ms), "--max-batch", str(args.max_batch)
                )
                yield Stack(gw.url, r, http, worker, PREFIX, probe.url)
            finally:
                await r.aclose()
                cluster.close()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"step_ms": args.step_ms if not args.url else None}
    with tempfile.TemporaryDirectory() as tmp:
        async with stack(args, Path(tmp)) as s:
            for name in args.sections.split(","):
                figures.update(await SECTIONS[name](s, args))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sections", default="ingest,throughput,ttft")
    ap.add_argument("--url", help="a running genq gateway (else one is started with the sim)")
    ap.add_argument("--redis-url", help="with --url: its Redis, for the memory figures")
    ap.add_argument("--api-key")
    ap.add_argument("--model", default="sim")
    ap.add_argument("--ingest-lines", type=int, default=50_000)
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=16, help="words of system prompt")
    ap.add_argument("--probes", type=int, default=100)
    ap.add_argument(
        "--backlog-lines",
        type=int,
        default=30_000,
        help="ttft: the backlog batch (open lines stay over 10,000 through the probes)",
    )
    ap.add_argument("--live-concurrency", type=int, default=256)
    ap.add_argument("--load-concurrency", type=int, default=32, help="ttft: interactive load")
    ap.add_argument("--load-requests", type=int, default=1000)
    ap.add_argument(
        "--split-gateways",
        action="store_true",
        help="interactive traffic to a second gateway that runs no batch loops",
    )
    ap.add_argument("--step-ms", type=float, default=0)
    ap.add_argument("--max-batch", type=int, default=256)
    args = ap.parse_args()
    figures = asyncio.run(main_async(args))
    for k, v in figures.items():
        print(f"{k:>36}: {v}")


if __name__ == "__main__":
    main()
