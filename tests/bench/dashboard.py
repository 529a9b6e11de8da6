"""Benchmark of /dashboard. Prints its figures.

    python -m tests.bench.dashboard                       # interval 0.5 s (the default)
    python -m tests.bench.dashboard --interval 0.1 --samples 100

It starts its own redis-server, one `genq gateway` (GENQ_DASHBOARD_INTERVAL_S=--interval) and
a sim `genq worker`, and stops them at the end.

latency  --samples jobs, one at a time at random phases of the round: from the job's state
         change in Redis (the recent-jobs stream entry SUBMIT or its end wrote: Redis's
         clock, the same host's) to (a) the frame that shows it arriving on an SSE stream
         and (b) the row showing it in /dashboard in headless Chromium (a MutationObserver
         notes when each job's row first shows each status); p50/p99/max, submitted
         (queued) and ended (succeeded) apart. (b) is skipped without chromium.
cpu      the gateway process's CPU (user + system over wall time) during --cpu-s seconds of
         --rate jobs/s, with 0, 1 and 20 viewers each reading one SSE stream; and the bytes
         a viewer receives per second.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from genq.stats import percentile
from shared.keys import Keys
from tests.cdp import Page, browser, chromium_path
from tests.procs import Cluster, redis_server

OBSERVER = """
window.__seen = {};
new MutationObserver(() => {
  const t = Date.now();
  for (const row of document.querySelectorAll('#jobs tr[data-job-id]')) {
    const k = row.dataset.jobId + ':' + row.dataset.status;
    if (!(k in window.__seen)) window.__seen[k] = t;
  }
}).observe(document.getElementById('jobs'), {subtree: true, childList: true});
true
"""


class Viewer(threading.Thread):
    """One SSE reader of /dashboard/events: when each job first showed each status (its
    clock), and the bytes it received."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.seen: dict[tuple[str, str], float] = {}
        self.first: dict[str, float] = {}
        self.bytes = 0
        self.ready = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.stream("GET", f"{self.url}/dashboard/events", timeout=60) as r:
            buf = ""
            for chunk in r.iter_text():
                now = time.time()
                self.bytes += len(chunk.encode())
                buf += chunk
                *frames, buf = buf.split("\n\n")
                for frame in frames:
                    self._frame(frame, now)
                if self.stop.is_set():
                    return

    def _frame(self, frame: str, now: float) -> None:
        for line in frame.splitlines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                self.ready.set()
                for job in data.get("jobs", {}).get("rows", {}).values():
                    self.first.setdefault(job["id"], now)
                    self.seen.setdefault((job["id"], job["status"]), now)


def _entry_times(r: redis.Redis, keys: Keys) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for entry_id, fields in r.xrange(keys.recent_jobs()):
        out.setdefault((fields["job"], fields["status"]), int(entry_id.split("-")[0]) / 1000)
    return out


def _stats(values: list[float]) -> str:
    if not values:
        return "no samples"
    p50, p99 = percentile(values, 50), percentile(values, 99)
    assert p50 is not None and p99 is not None
    top, n = max(values), len(values)
    return f"p50 {p50 * 1e3:.0f} ms  p99 {p99 * 1e3:.0f} ms  max {top * 1e3:.0f} ms  (n={n})"


def _post(url: str, max_tokens: int) -> str:
    body = {"model": "sim", "prompt": "x", "max_tokens": max_tokens}
    r = httpx.post(f"{url}/v1/jobs", json=body, timeout=10)
    r.raise_for_status()
    return str(r.json()["id"])


def latency(url: str, r: redis.Redis, keys: Keys, args: argparse.Namespace, tmp: Path) -> None:
    viewer = Viewer(url)
    viewer.start()
    viewer.ready.wait(10)
    page_seen: dict[str, float] = {}
    with _page(url, tmp) as page:
        ids = []
        rng = random.Random(1)
        for _ in range(args.samples):
            time.sleep(rng.uniform(0, args.interval))
            ids.append(_post(url, args.max_tokens))
        time.sleep(2 * args.interval + 1)
        if page is not None:
            page_seen = {k: v / 1000 for k, v in page.evaluate("window.__seen").items()}
    viewer.stop.set()
    changes = _entry_times(r, keys)
    print(f"latency, GENQ_DASHBOARD_INTERVAL_S={args.interval}, {args.samples} jobs:")
    for label, status in (("submitted", "queued"), ("ended", "succeeded")):
        sse = []
        page = []
        for job in ids:
            at = changes.get((job, status))
            if at is None:
                continue
            got = viewer.first.get(job) if status == "queued" else viewer.seen.get((job, status))
            if got is not None:
                sse.append(got - at)
            shown = [v for k, v in page_seen.items() if k.startswith(job + ":")]
            seen = min(shown) if status == "queued" and shown else page_seen.get(f"{job}:{status}")
            if seen is not None:
                page.append(seen - at)
        print(f"  {label:9} → SSE frame   {_stats(sse)}")
        if page_seen:
            print(f"  {label:9} → page row    {_stats(page)}")


class _NoPage:
    def __enter__(self) -> None:
        print("  (no chromium: the page figure is skipped)")

    def __exit__(self, *exc: object) -> None:
        return None


def _page(url: str, tmp: Path) -> Any:
    if chromium_path() is None:
        return _NoPage()
    return _OpenPage(url, tmp)


class _OpenPage:
    def __init__(self, url: str, tmp: Path) -> None:
        self._cm = browser(tmp / "profile")
        self.url = url

    def __enter__(self) -> Page:
        page = self._cm.__enter__()
        page.open(f"{self.url}/dashboard")
        page.wait("document.body.dataset.state === 'live'")
        page.evaluate(OBSERVER)
        return page

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)


def _load(url: str, rate: float, stop: threading.Event, max_tokens: int) -> None:
    while not stop.is_set():
        _post(url, max_tokens)
        time.sleep(1 / rate)


def _commands(r: redis.Redis) -> int:
    return int(r.info("stats")["total_commands_processed"])


def cpu(url: str, pid: int, r: redis.Redis, args: argparse.Namespace) -> None:
    proc = psutil.Process(pid)
    print(f"gateway CPU, {args.rate:g} jobs/s, {args.cpu_s:g} s each:")
    base: tuple[float, float] | None = None
    for n in (0, 1, 20):
        viewers = [Viewer(url) for _ in range(n)]
        for v in viewers:
            v.start()
        for v in viewers:
            v.ready.wait(10)
        stop = threading.Event()
        load = threading.Thread(target=_load, args=(url, args.rate, stop, args.max_tokens))
        load.start()
        time.sleep(1)  # past the viewers' first, full frames
        t0, c0, r0 = time.monotonic(), sum(proc.cpu_times()[:2]), _commands(r)
        b0 = sum(v.bytes for v in viewers)
        time.sleep(args.cpu_s)
        wall, used = time.monotonic() - t0, sum(proc.cpu_times()[:2]) - c0
        commands = (_commands(r) - r0) / wall
        received = sum(v.bytes for v in viewers) - b0
        stop.set()
        load.join()
        for v in viewers:
            v.stop.set()
        share = used / wall * 100
        base = (share, commands) if base is None else base
        per = f", {received / wall / n / 1024:.1f} KiB/s per viewer" if n else ""
        print(
            f"  {n:2} viewers: {share:5.1f} % of a core ({share - base[0]:+.1f} vs none), "
            f"Redis {commands:.0f} commands/s ({commands - base[1]:+.0f}){per}"
        )
        time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--cpu-s", type=float, default=20.0)
    p.add_argument("--sections", default="latency,cpu")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="genq-bench-dash-") as tmp, redis_server() as rs:
        prefix = f"benchdash:{uuid.uuid4().hex[:6]}:"
        cluster = Cluster(
            rs.url,
            Path(tmp),
            prefix,
            GENQ_DASHBOARD_INTERVAL_S=str(args.interval),
            GENQ_HEARTBEAT_S="1",
        )
        try:
            gateway = cluster.gateway()
            cluster.worker("--step-ms", str(args.step_ms))
            r = redis.Redis.from_url(rs.url, decode_responses=True)
            if "latency" in sections:
                latency(gateway.url, r, Keys(prefix), args, Path(tmp))
            if "cpu" in sections:
                assert gateway.port is not None
                cpu(gateway.url, gateway.proc.pid, r, args)
        finally:
            cluster.close()


if __name__ == "__main__":
    main()
