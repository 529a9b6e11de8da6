"""Benchmark of the whole CPU pipeline: `genq gateway` + `genq worker --engine sim` + Redis,
loaded by `genq bench`. Prints the bench figures, the CPU seconds each process used, and the
worker-side timing breakdown (queue wait, time to first token) read back from the job records.

    python -m tests.bench.pipeline --concurrency 256 --requests 1024 --max-tokens 200 --step-ms 0
    python -m tests.bench.pipeline --constrained ...   # the same, unconstrained then under a schema
    python -m tests.bench.pipeline --compare-apis chat,responses ...   # one route, then another
    python -m tests.bench.pipeline --compare-webhooks ...   # without webhooks, then with
        [--receiver uvicorn]   # the receiver (tests/bench/webhooks.py): raw by default
        [--rounds 5]   # in turns, N of each: every pair's ratio and their median

Starts a private redis-server (or uses --redis-url) and its own processes; stops them at the end.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from genq.procstats import children, cpu_seconds
from genq.stats import ms, percentile
from tests.procs import Cluster, redis_server

if TYPE_CHECKING:
    from tests.bench.webhooks import Receiver

SETTLE_S = 5.0
SETTLE_POLL_S = 1.1
"""A little over the worker's heartbeat interval (1 s by default)."""


def worker_timings(url: str, prefix: str) -> dict[str, float]:
    r = redis.Redis.from_url(url, decode_responses=True)
    queue, ttft = [], []
    for key in r.scan_iter(match=f"{prefix}job:*", count=1000):
        raw = r.hget(key, "timings")
        if raw:
            t = json.loads(raw)
            queue.append(t["queue_s"])
            ttft.append(t["ttft_s"])
    lens = [r.xlen(k) for k in list(r.scan_iter(match=f"{prefix}events:*", count=1000))[:200]]

    def p(v: list[float], q: float) -> float | None:
        return ms(percentile(v, q), 2)

    return {
        "worker_queue_ms_p50": p(queue, 50),
        "worker_queue_ms_p99": p(queue, 99),
        "worker_ttft_ms_p50": p(ttft, 50),
        "worker_ttft_ms_p99": p(ttft, 99),
        "events_per_job": round(sum(lens) / max(1, len(lens)), 1),
    }


Counters = tuple[int, float, int, float]
"""A heartbeat's cumulative steps, engine step seconds, worker-timed steps and their seconds."""


def step_counters(url: str, prefix: str) -> Counters | None:
    """The worker's counters; None from a worker that does not report them."""
    r = redis.Redis.from_url(url, decode_responses=True)
    for key in r.scan_iter(match=f"{prefix}worker:*"):
        b = r.hgetall(key)
        if "steps" in b:
            return (
                int(b["steps"]),
                float(b["engine_step_s"]),
                int(b["worker_steps"]),
                float(b["worker_step_s"]),
            )
    return None


def settled_counters(url: str, prefix: str) -> Counters | None:
    """The counters once the engine is idle: two heartbeats that agree."""
    last = step_counters(url, prefix)
    deadline = time.monotonic() + SETTLE_S
    while last is not None and time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
        now = step_counters(url, prefix)
        if now == last:
            break
        last = now
    return last


def step_figures(before: Counters | None, after: Counters | None) -> dict[str, float | None]:
    """Steps the engine made in the run; the mean time of its own step, and of a step as the
    worker saw them arrive (the difference: what the engine boundary costs per step)."""
    if before is None or after is None or after[0] == before[0]:
        return {"engine_steps": None}
    d = [a - b for a, b in zip(after, before, strict=True)]
    return {
        "engine_steps": int(d[0]),
        "engine_step_ms": round(d[1] / d[0] * 1000, 4),
        "worker_step_ms": round(d[3] / d[2] * 1000, 4) if d[2] else None,
    }


EVENTS_WAIT_S = 120.0
"""How long the deliveries may go on after the load has ended."""


def wait_for_events(receiver: Receiver, want: int, ended: float) -> dict[str, float | None]:
    """Wait for the receiver to hold `want` events; how long after the load's end (`ended`,
    perf_counter) the last one came (None: not all came)."""
    deadline = time.perf_counter() + EVENTS_WAIT_S
    while len(receiver.arrived) < want and time.perf_counter() < deadline:
        time.sleep(0.01)
    done = len(receiver.arrived) >= want
    return {"events_after_load_s": round(time.perf_counter() - ended, 2) if done else None}


def run(args: argparse.Namespace, redis_url: str, tmp: Path, redis_pid: int | None = None) -> dict:
    prefix = f"bench:{uuid.uuid4().hex[:6]}:"
    env = getattr(args, "env", None) or {}
    cluster = Cluster(redis_url, tmp, prefix, **env)
    try:
        gw = cluster.gateway(processes=args.gateway_procs)
        worker = cluster.worker("--step-ms", str(args.step_ms), "--max-batch", str(args.max_batch))
        procs = {"gateway": gw.proc.pid, "worker": worker.proc.pid}
        if redis_pid is not None:
            procs["redis"] = redis_pid
        for pid in children(worker.proc.pid):  # its engine process
            procs["engine"] = pid
        if args.gateway_procs > 1:  # uvicorn's children do the work
            for i, pid in enumerate(children(gw.proc.pid)):
                procs[f"gateway{i}"] = pid
        before = {k: cpu_seconds(p) for k, p in procs.items()}
        counters = step_counters(redis_url, prefix) if redis_url else None  # none: a cluster
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        own = resource.getrusage(resource.RUSAGE_SELF)
        receiver = getattr(args, "receiver", None)
        told = len(receiver.arrived) if receiver is not None else 0
        t0 = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "genq",
                "bench",
                "--url",
                gw.url,
                "--concurrency",
                str(args.concurrency),
                "--requests",
                str(args.requests),
                "--max-tokens",
                str(args.max_tokens),
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--json",
                "--api",
                args.api,
                *(["--json-schema", args.json_schema] if args.json_schema else []),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        wall = time.perf_counter() - t0
        figures = json.loads(out.stdout)
        if receiver is not None and env:  # the deliveries still under way count too
            figures.update(wait_for_events(receiver, told + args.requests, t0 + wall))
        figures["cpu_s"] = {k: round(cpu_seconds(p) - before[k], 2) for k, p in procs.items()}
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        bench_cpu = after.ru_utime + after.ru_stime - reaped.ru_utime - reaped.ru_stime
        figures["cpu_s"]["bench"] = round(bench_cpu, 2)
        if receiver is not None:  # its thread: this process does nothing else meanwhile
            mine = resource.getrusage(resource.RUSAGE_SELF)
            used = mine.ru_utime + mine.ru_stime - own.ru_utime - own.ru_stime
            figures["cpu_s"]["receiver"] = round(used, 2)
        figures["cpu_s_total"] = round(sum(figures["cpu_s"].values()), 2)
        figures["bench_wall_s"] = round(wall, 2)
        if redis_url:  # these read one Redis's keys (tests/bench/cluster.py: a cluster)
            figures.update(worker_timings(redis_url, prefix))
            figures.update(step_figures(counters, settled_counters(redis_url, prefix)))
        figures["step_ms"] = args.step_ms
        return figures
    finally:
        cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=0)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--gateway-procs", type=int, default=1)
    ap.add_argument("--redis-url")
    ap.add_argument(
        "--constrained",
        action="store_true",
        help="run the workload twice, unconstrained and then every job under a JSON schema "
        "whose output outlasts max_tokens (`LONG_SCHEMA`), and print both and their ratio",
    )
    ap.add_argument("--api", default="native", help="genq bench's route (native, openai, …)")
    ap.add_argument(
        "--compare-apis",
        metavar="A,B",
        help="run the workload on route A, then on route B, and print both and B's tokens/s "
        "over A's (e.g. chat,responses)",
    )
    ap.add_argument(
        "--compare-webhooks",
        action="store_true",
        help="run the workload without webhooks, then with a deployment endpoint told of "
        "every job's end (a local receiver), and print both and their ratio",
    )
    ap.add_argument(
        "--receiver",
        dest="receiver_kind",
        choices=("raw", "uvicorn"),
        default="raw",
        help="with --compare-webhooks: the local receiver (tests/bench/webhooks.py)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --compare-webhooks: run the two in turns this many times each, and print "
        "each pair's ratios and their medians (a shared box drifts between runs)",
    )
    args = ap.parse_args()
    args.json_schema = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.compare_webhooks:
            from tests.bench.webhooks import Receiver, start_receiver, webhook_env

            args.receiver = Receiver()
            hook, stop = start_receiver(args.receiver, args.receiver_kind)
            pairs: list[dict[str, Any]] = []
            for _ in range(args.rounds):
                args.env = {}
                pair: dict[str, Any] = {"none": run_once(args, Path(tmp))}
                arrived = len(args.receiver.arrived)
                args.env = webhook_env(hook, ["job.succeeded"])
                pair["webhooks"] = run_once(args, Path(tmp))
                pair["webhooks"]["events_received"] = len(args.receiver.arrived) - arrived
                pair.update(webhook_ratios(pair["none"], pair["webhooks"], args.requests))
                pairs.append(pair)
            stop()
            result: dict[str, Any] = pairs[0] if args.rounds == 1 else {"rounds": pairs}
            if args.rounds > 1:
                for k in ("tokens_per_s_ratio", "cpu_per_token_ratio", "gateway_cpu_ms_per_event"):
                    result[f"{k}_each"] = [p[k] for p in pairs]
                    result[f"{k}_median"] = statistics.median(p[k] for p in pairs)
        elif args.compare_apis:
            first, second = args.compare_apis.split(",")
            result = {}
            for api in (first, second):
                args.api = api
                result[api] = run_once(args, Path(tmp))
            result["tokens_per_s_ratio"] = round(
                result[second]["tokens_per_s"] / result[first]["tokens_per_s"], 3
            )
        elif args.constrained:
            schema = Path(tmp) / "schema.json"
            schema.write_text(json.dumps(LONG_SCHEMA))
            result = {"none": run_once(args, Path(tmp))}
            args.json_schema = str(schema)
            result["constrained"] = run_once(args, Path(tmp))
            result["tokens_per_s_ratio"] = round(
                result["constrained"]["tokens_per_s"] / result["none"]["tokens_per_s"], 3
            )
        else:
            result = run_once(args, Path(tmp))
    print(json.dumps(result, indent=1))


def webhook_ratios(none: dict[str, Any], hooks: dict[str, Any], requests: int) -> dict[str, float]:
    """With webhooks against without: tokens/s; the same by CPU, steadier on a shared box (all
    CPU seconds, the receiver's too, per token); the gateway's CPU per event sent."""
    return {
        "tokens_per_s_ratio": round(hooks["tokens_per_s"] / none["tokens_per_s"], 3),
        "cpu_per_token_ratio": round(
            hooks["cpu_s_total"] / hooks["tokens"] / (none["cpu_s_total"] / none["tokens"]), 3
        ),
        "gateway_cpu_ms_per_event": round(
            (hooks["cpu_s"]["gateway"] - none["cpu_s"]["gateway"]) * 1000 / requests, 3
        ),
    }


LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 1000},
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}
"""A JSON schema no job of the benchmark completes (1,000 items): each runs to max_tokens,
as the unconstrained jobs do, so the two runs generate the same tokens."""


def run_once(args: argparse.Namespace, tmp: Path) -> dict:
    if args.redis_url:
        return run(args, args.redis_url, tmp)
    with redis_server() as server:
        assert server.proc is not None
        return run(args, server.url, tmp, server.proc.pid)


if __name__ == "__main__":
    main()
