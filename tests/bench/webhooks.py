"""Benchmark of webhook delivery on the CPU: `genq gateway` + `genq worker --engine sim` +
Redis, a deployment endpoint (`job.succeeded`) on a local receiver, in a thread of the bench:
`raw` (the default: llhttp in an asyncio protocol, the least CPU a receiver can take of the
box's cores) or `uvicorn` (an ASGI app, as a Python app would be served).

    python -m tests.bench.webhooks [--jobs 2000] [--concurrency 64] [--receiver uvicorn]

1. Live: queues `--jobs` one-token jobs, `--concurrency` at a time, and prints the events per
   second (from the first job's end to the last event received) and the delay from each job's
   end (its record's `finished_at`) to its event's arrival, p50 and p99: the sending gateway
   also takes the submissions (on a small box they share its CPU).
2. Drain: the same number of jobs run while no gateway may send (the lease held by the
   bench), then the lease is let go: the deliveries per second of the backlog alone, and the
   sending gateway's CPU per delivery meanwhile (it does nothing else then).

The cost of webhooks on the pipeline's tokens/s: `python -m tests.bench.pipeline
--compare-webhooks`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools
import httpx
import redis as redis_sync
import uvicorn

from genq.procstats import cpu_seconds
from genq.stats import ms, percentile
from tests.procs import Cluster, free_port, redis_server

RECEIVERS = ("raw", "uvicorn")
SECRET = "whsec_" + base64.b64encode(b"genq-webhook-bench-key-32-bytes!").decode()


class Receiver:
    """An ASGI app that notes when each event arrived, by the id it is about."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if body:
            self.arrived.setdefault(json.loads(body)["data"]["id"], time.time())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


class _RawHook(asyncio.Protocol):
    """One connection of the raw receiver: each request noted as the ASGI app notes it, and
    answered 204."""

    def __init__(self, arrived: dict[str, float]) -> None:
        self.arrived = arrived
        self.parser = httptools.HttpRequestParser(self)
        self.body = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        if self.body:
            self.arrived.setdefault(json.loads(self.body)["data"]["id"], time.time())
        self.body.clear()
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")


def start_receiver(app: Receiver, kind: str = "raw") -> tuple[str, Callable[[], None]]:
    """Serve `app` (its `arrived`, for `raw`) on loopback in a thread; its URL and its stop."""
    port = free_port()
    if kind == "raw":
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(
            loop.create_server(lambda: _RawHook(app.arrived), "127.0.0.1", port)
        )
        threading.Thread(target=loop.run_forever, daemon=True).start()
        return f"http://127.0.0.1:{port}/hook", lambda: loop.call_soon_threadsafe(server.close)
    uv = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    threading.Thread(target=uv.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)

    def stop() -> None:
        uv.should_exit = True

    return f"http://127.0.0.1:{port}/hook", stop


def webhook_env(url: str, events: list[str]) -> dict[str, str]:
    return {
        "GENQ_WEBHOOKS": json.dumps([{"url": url, "secret": SECRET, "events": events}]),
        "GENQ_WEBHOOK_ALLOW_HTTP": "true",
        "GENQ_WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]',
        "GENQ_WEBHOOK_POLL_S": "0.05",
    }


async def submit_all(url: str, n: int, concurrency: int) -> list[str]:
    sem = asyncio.Semaphore(concurrency)
    ids: list[str] = []
    async with httpx.AsyncClient(timeout=60) as http:

        async def one(i: int) -> None:
            async with sem:
                body = {"model": "sim", "prompt": f"event {i}", "max_tokens": 1, "seed": i}
                r = await http.post(f"{url}/v1/jobs", json=body)
                r.raise_for_status()
                ids.append(r.json()["id"])

        await asyncio.gather(*(one(i) for i in range(n)))
    return ids


def run(args: argparse.Namespace) -> dict[str, Any]:
    app = Receiver()
    hook, stop = start_receiver(app, args.receiver)
    with tempfile.TemporaryDirectory() as tmp, redis_server() as rs:
        prefix = f"bench:{uuid.uuid4().hex[:6]}:"
        cluster = Cluster(rs.url, Path(tmp), prefix)
        try:
            env = webhook_env(hook, ["job.succeeded"])
            gw = cluster.gateway(**env)
            cluster.worker("--step-ms", "1", **env)
            ids = asyncio.run(submit_all(gw.url, args.jobs, args.concurrency))
            deadline = time.monotonic() + args.jobs / 10 + 60
            while len(app.arrived) < len(ids) and time.monotonic() < deadline:
                time.sleep(0.1)
            r = redis_sync.Redis.from_url(rs.url, decode_responses=True)
            ended = {i: float(r.hget(f"{prefix}job:{{{i}}}", "finished_at") or 0.0) for i in ids}
            lease = f"{prefix}webhooks:lease"
            r.set(lease, "bench", px=600_000)  # the holder's next round finds it another's
            time.sleep(1.0)
            more = asyncio.run(submit_all(gw.url, args.jobs, args.concurrency))
            while r.xlen(f"{prefix}webhooks:outbox") < len(more):
                time.sleep(0.1)
            cpu0 = cpu_seconds(gw.proc.pid)
            r.delete(lease)
            t0 = time.time()
            while len(app.arrived) < len(ids) + len(more) and time.time() < t0 + 120:
                time.sleep(0.02)
            drain_s = max(app.arrived[i] for i in more if i in app.arrived) - t0
            drain_cpu_s = cpu_seconds(gw.proc.pid) - cpu0
        finally:
            cluster.close()
            stop()
    delays = [app.arrived[i] - ended[i] for i in ids if i in app.arrived and ended[i]]
    first_end = min(ended.values())
    last = max(app.arrived.values()) if app.arrived else first_end
    return {
        "jobs": len(ids),
        "events_received": len(app.arrived),
        "events_per_s": round(len(app.arrived) / max(1e-9, last - first_end), 1),
        "delay_ms_p50": ms(percentile(delays, 50), 1),
        "delay_ms_p99": ms(percentile(delays, 99), 1),
        "drain_events": args.jobs,
        "drain_events_per_s": round(args.jobs / max(1e-9, drain_s), 1),
        "drain_gateway_cpu_ms_per_event": round(drain_cpu_s * 1000 / args.jobs, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--receiver", choices=RECEIVERS, default="raw")
    print(json.dumps(run(ap.parse_args()), indent=1))


if __name__ == "__main__":
    main()
