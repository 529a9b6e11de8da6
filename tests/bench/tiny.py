"""Benchmark: tiny jobs and batch feeding, the three figures side by side.

    python -m tests.bench.tiny                       # all three sections
    python -m tests.bench.tiny --sections batch,drain --repeat 3
    python -m tests.bench.tiny --profile /tmp/prof   # py-spy on every genq process

Sections (`--sections`, comma-separated; each starts its own redis-server, one `genq gateway`
and sim workers with --step-ms steps, and stops them after):
  batch  a --batch-lines batch (Batch API, `/v1/completions`) of --tiny-tokens new tokens a
         line on --batch-workers workers of --slots slots: jobs/s from the batch's creation
         to its end, and the mean jobs in the engines' batches meanwhile
  drain  --drain-jobs `batch`-priority `POST /v1/jobs` jobs of --tiny-tokens tokens (raw
         keep-alive HTTP from --concurrency clients) queued while one worker of --slots
         slots is stopped (SIGSTOP), then drained: jobs/s from the first job done to the
         last (the queue's length, read in Redis: an entry goes with its job's end)
  feed   a --feed-lines batch of --feed-tokens tokens a line (a shared system prompt of
         --feed-system-words words: the file takes ~36 chunks) on --batch-workers workers of
         --feed-slots slots: seconds to its end against the slot-bound ideal (every slot busy
         from the start: lines × (tokens + 1) steps over all slots), and the jobs running
         and chunks still unqueued at the 40 % mark

Each section also prints the CPU seconds each process spent in its measured part (where the
time goes; steadier than seconds on a shared box); with --profile DIR, py-spy records each
one then (DIR/<section>-<process>.txt: the hottest frames; the raw collapsed stacks beside).
The workers' /metrics are read once a second (a render costs a worker milliseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from genq.bench import Target, _read_head
from shared.keys import Keys
from tests.bench.drain import metric
from tests.procs import Cluster, Proc, engine_processes, free_port, redis_server, wait_for

POLL_S = 0.1
METRICS_EVERY = 10
"""Polls between two reads of the workers' /metrics (a render costs a worker milliseconds:
read ten times a second it would take a tenth of a core from the work measured)."""
MARK = 0.4
"""The feed section reads the jobs running and the chunks unqueued when this share is done."""
PROMPT_WORDS = "is this review positive or negative the food was cold but the staff kind"
ENDED = ("completed", "failed", "expired", "cancelled")
TOP_FRAMES = 40


class Processes:
    """The genq processes of one section (gateway, workers, their engines, redis-server):
    CPU seconds over a measured part, and py-spy on each meanwhile with --profile."""

    def __init__(
        self, named: dict[str, int], profile: Path | None, section: str, idle: bool = False
    ) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in named.items()}
        self.profile = profile
        self.idle = idle
        """py-spy's --idle: waiting threads sampled too."""
        self.section = section
        self._spies: dict[str, subprocess.Popen[bytes]] = {}
        self._cpu0: dict[str, float] = {}

    def _cpu(self, name: str) -> float:
        with contextlib.suppress(psutil.Error):
            t = self.procs[name].cpu_times()
            return float(t.user + t.system)
        return 0.0

    def start(self) -> None:
        self._cpu0 = {n: self._cpu(n) for n in self.procs}
        spy = shutil.which("py-spy")
        if self.profile is None or spy is None:
            return
        self.profile.mkdir(parents=True, exist_ok=True)
        for name, p in self.procs.items():
            if name == "redis":
                continue
            raw = self.profile / f"{self.section}-{name}.raw"
            self._spies[name] = subprocess.Popen(
                [spy, "record", "--pid", str(p.pid), "--format", "raw", "-o", str(raw)]
                + (["--idle"] if self.idle else [])
                + ["--rate", "200", "--nonblocking"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def stop(self) -> dict[str, float]:
        used = {n: round(self._cpu(n) - self._cpu0.get(n, 0.0), 2) for n in self.procs}
        for name, spy in self._spies.items():
            spy.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(30)
            assert self.profile is not None
            raw = self.profile / f"{self.section}-{name}.raw"
            if raw.exists():
                (self.profile / f"{self.section}-{name}.txt").write_text(hottest(raw))
        return used


def hottest(raw: Path) -> str:
    """The frames that most samples were in (self) and under (total), from py-spy's raw
    collapsed stacks."""
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for f in set(frames):
            under[f] += n
    out = [f"{total} samples", "", "self:"]
    out += [f"{100 * n / total:6.1f}%  {f}" for f, n in own.most_common(TOP_FRAMES)]
    out += ["", "total:"]
    out += [f"{100 * n / total:6.1f}%  {f}" for f, n in under.most_common(TOP_FRAMES)]
    return "\n".join(out) + "\n"


@contextlib.contextmanager
def cluster(args: argparse.Namespace) -> Iterator[Cluster]:
    env = dict(kv.split("=", 1) for kv in args.env)
    with tempfile.TemporaryDirectory() as tmp, redis_server() as server:
        c = Cluster(server.url, Path(tmp), f"benchtiny:{uuid.uuid4().hex[:6]}:", **env)
        c.redis_pid = server.proc.pid if server.proc else 0  # type: ignore[attr-defined]
        try:
            yield c
        finally:
            for p in reversed(c.procs):
                p.stop()
            c.close()
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                for p in c.procs:
                    shutil.copy(p.log, args.logs / p.log.name)


def workers(c: Cluster, n: int, args: argparse.Namespace, slots: int) -> list[tuple[Proc, int]]:
    """`n` sim workers, each with a metrics port: [(worker, port)]."""
    out = []
    for _ in range(n):
        port = free_port()
        w = c.worker(
            "--step-ms",
            str(args.step_ms),
            "--max-batch",
            str(slots),
            GENQ_METRICS_PORT=str(port),
        )
        out.append((w, port))
    return out


def named(c: Cluster, gw: Proc, ws: list[tuple[Proc, int]]) -> dict[str, int]:
    out = {"gateway": gw.proc.pid, "redis": c.redis_pid}  # type: ignore[attr-defined]
    for i, (w, _) in enumerate(ws):
        out[f"worker{i}"] = w.proc.pid
        wait_for(lambda w=w: engine_processes(w.proc.pid), what="an engine process")
        out[f"engine{i}"] = engine_processes(w.proc.pid)[0].pid
    return out


def running(http: httpx.Client, ws: list[tuple[Proc, int]]) -> float:
    total = 0.0
    for _, port in ws:
        with contextlib.suppress(httpx.HTTPError):
            text = http.get(f"http://127.0.0.1:{port}/metrics").text
            total += metric(text, "genq_num_requests_running")
    return total


def batch_file(lines: int, tokens: int, system_words: int = 0) -> bytes:
    """Completion requests: a shared system prompt of `system_words` words, then a short
    question of each line's own."""
    words = PROMPT_WORDS.split()
    system = " ".join(words[i % len(words)] for i in range(system_words))
    out = []
    for i in range(lines):
        prompt = f"{system}\n{PROMPT_WORDS} {i}"
        body = {"model": "sim", "prompt": prompt, "max_tokens": tokens, "seed": i}
        out.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return "".join(json.dumps(x) + "\n" for x in out).encode()


def run_batch(
    http: httpx.Client,
    url: str,
    lines: int,
    tokens: int,
    ws: list[tuple[Proc, int]],
    procs: Processes,
    redis_url: str,
    system_words: int = 0,
) -> dict[str, Any]:
    """Upload, create, follow to the end: seconds from creation, mean jobs running, and at
    the MARK share done the jobs running and the chunks not queued yet."""
    f = http.post(
        f"{url}/v1/files",
        data={"purpose": "batch"},
        files={"file": ("tiny.jsonl", batch_file(lines, tokens, system_words))},
    )
    f.raise_for_status()
    body = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions"}
    body["completion_window"] = "24h"
    procs.start()
    t0 = time.perf_counter()
    b = http.post(f"{url}/v1/batches", json=body).json()
    seen: list[float] = []
    at_mark: dict[str, Any] = {}
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    polls = 0
    while b["status"] not in ENDED:
        time.sleep(POLL_S)
        polls += 1
        b = http.get(f"{url}/v1/batches/{b['id']}").json()
        done = b["request_counts"]["completed"] + b["request_counts"]["failed"]
        marked = not at_mark and done >= MARK * lines
        if polls % METRICS_EVERY == 0 or marked:
            seen.append(running(http, ws))
        if marked:
            raw = r.hgetall(next(r.scan_iter(f"*batch:{{{b['id']}}}")))
            chunks = len(json.loads(raw["chunks"]))
            at_mark = {
                "running_at_40pct": seen[-1],
                "chunks_unqueued_at_40pct": f"{chunks - int(raw['queued_chunks'])} of {chunks}",
            }
    took = time.perf_counter() - t0
    r.close()
    return {
        "status": b["status"],
        "failed": b["request_counts"]["failed"],
        "s": round(took, 2),
        "jobs_per_s": round(lines / took, 1),
        "running_mean": round(statistics.mean(seen), 1) if seen else None,
        **at_mark,
        "cpu_s": procs.stop(),
    }


def section_batch(args: argparse.Namespace) -> dict[str, Any]:
    with cluster(args) as c, httpx.Client(timeout=120) as http:
        gw = c.gateway()
        ws = workers(c, args.batch_workers, args, args.slots)
        procs = Processes(named(c, gw, ws), args.profile, "batch", args.profile_idle)
        out = run_batch(http, gw.url, args.batch_lines, args.tiny_tokens, ws, procs, c.redis_url)
    ceiling = args.batch_workers * args.slots / ((args.tiny_tokens + 1) * args.step_ms / 1000)
    return {"lines": args.batch_lines, **out, "ceiling_jobs_per_s": round(ceiling, 1)}


def section_feed(args: argparse.Namespace) -> dict[str, Any]:
    with cluster(args) as c, httpx.Client(timeout=120) as http:
        gw = c.gateway()
        ws = workers(c, args.batch_workers, args, args.feed_slots)
        procs = Processes(named(c, gw, ws), args.profile, "feed", args.profile_idle)
        out = run_batch(
            http,
            gw.url,
            args.feed_lines,
            args.feed_tokens,
            ws,
            procs,
            c.redis_url,
            args.feed_system_words,
        )
    slots = args.batch_workers * args.feed_slots
    ideal = args.feed_lines * (args.feed_tokens + 1) * args.step_ms / 1000 / slots
    return {
        "lines": args.feed_lines,
        **out,
        "ideal_s": round(ideal, 1),
        "s_over_ideal": round(out["s"] / ideal, 2),
    }


async def submit_raw(url: str, jobs: int, max_tokens: int, concurrency: int) -> float:
    """`jobs` `POST /v1/jobs` (batch priority) over `concurrency` keep-alive connections of
    raw HTTP/1.1 (httpx would take more CPU than the gateway it feeds); jobs/s."""
    target = Target.from_url(url, None)
    left = iter(range(jobs))

    async def one() -> None:
        reader, writer = await target.connect()
        try:
            for i in left:
                body = {"model": "sim", "prompt": "is this review positive?"}
                body |= {"max_tokens": max_tokens, "priority": "batch", "seed": i}
                writer.write(target.request("POST", "/v1/jobs", json.dumps(body).encode()))
                status, headers = await _read_head(reader)
                data = await reader.readexactly(int(headers.get("content-length", "0")))
                if status >= 300:
                    raise SystemExit(f"submit: {status} {data[:200]!r}")
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(concurrency)))
    return jobs / (time.perf_counter() - t0)


def section_drain(args: argparse.Namespace) -> dict[str, Any]:
    with cluster(args) as c:
        gw = c.gateway()
        ((w, port),) = workers(c, 1, args, args.slots)
        procs = Processes(named(c, gw, [(w, port)]), args.profile, "drain", args.profile_idle)
        w.signal(signal.SIGSTOP)
        filling = Processes({"gateway": gw.proc.pid}, args.profile, "submit")
        filling.start()
        try:
            rate = asyncio.run(
                submit_raw(gw.url, args.drain_jobs, args.tiny_tokens, args.concurrency)
            )
        finally:
            w.signal(signal.SIGCONT)
        submit_cpu = filling.stop()["gateway"]
        procs.start()
        seen: list[float] = []
        t_first = None
        done = 0.0
        deadline = time.monotonic() + args.timeout_s
        r = redis.Redis.from_url(c.redis_url)
        queue = Keys(c.env["GENQ_KEY_PREFIX"]).queue("sim", "batch")  # gone at its job's end
        with httpx.Client(timeout=5) as http:
            polls = 0
            while time.monotonic() < deadline and done < args.drain_jobs:
                done = args.drain_jobs - r.xlen(queue)
                now = time.perf_counter()
                if done and t_first is None:
                    t_first = now
                polls += 1
                if t_first is not None and polls % METRICS_EVERY == 0:
                    seen.append(running(http, [(w, port)]))
                time.sleep(POLL_S)
        t_last = time.perf_counter()
        r.close()
        cpu = procs.stop()
    if t_first is None or done < args.drain_jobs:
        raise SystemExit(f"the backlog did not drain within {args.timeout_s} s ({done:.0f})")
    ceiling = args.slots / ((args.tiny_tokens + 1) * args.step_ms / 1000)
    return {
        "jobs": args.drain_jobs,
        "submitted_per_s": round(rate, 1),
        "submit_gateway_cpu_ms_per_job": round(submit_cpu * 1000 / args.drain_jobs, 2),
        "s": round(t_last - t_first, 2),
        "jobs_per_s": round(args.drain_jobs / (t_last - t_first), 1),
        "running_mean": round(statistics.mean(seen), 1) if seen else None,
        "cpu_s": cpu,
        "ceiling_jobs_per_s": round(ceiling, 1),
    }


SECTIONS = {"batch": section_batch, "drain": section_drain, "feed": section_feed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sections", default="batch,drain,feed")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=20)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--tiny-tokens", type=int, default=4)
    ap.add_argument("--batch-lines", type=int, default=5000)
    ap.add_argument("--batch-workers", type=int, default=2)
    ap.add_argument("--drain-jobs", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64, help="drain: submitting clients")
    ap.add_argument("--feed-lines", type=int, default=2000)
    ap.add_argument("--feed-tokens", type=int, default=48)
    ap.add_argument("--feed-slots", type=int, default=32)
    ap.add_argument(
        "--feed-system-words",
        type=int,
        default=900,
        help="feed: words of the shared system prompt (900: the file takes ~36 chunks)",
    )
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--profile", type=Path, help="py-spy each process into this folder")
    ap.add_argument("--profile-idle", action="store_true", help="py-spy --idle: waits too")
    ap.add_argument("--logs", type=Path, help="copy the processes' logs into this folder")
    ap.add_argument("--env", action="append", default=[], help="K=V for every process")
    args = ap.parse_args()
    for i in range(args.repeat):
        for name in args.sections.split(","):
            figures = SECTIONS[name](args)
            print(json.dumps({"section": name, "round": i + 1, **figures}), flush=True)


if __name__ == "__main__":
    main()
