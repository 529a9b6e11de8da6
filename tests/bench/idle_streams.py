"""What idle streams cost: one `genq gateway` process and a private redis-server on
loopback, `--streams` SSE streams open on jobs that stay queued (no worker runs; the sim
model's card is written as a worker would). Prints, as JSON:

- Redis commands/s (`INFO stats` total_commands_processed) and the gateway's CPU (% of one
  core, psutil) over `--watch-s` seconds while every stream waits;
- the recovery after a pub/sub drop: `CLIENT KILL TYPE pubsub` and, in the same MULTI, one
  event logged and PUBLISHed to every job (to nobody: the gateway is not subscribed), then
  the time until every client has that event, and the Redis commands that took.

`--code DIR` runs the gateway from another checkout (its PYTHONPATH), to compare side by side:

    python -m tests.bench.idle_streams --streams 10000 --watch-s 20
    python -m tests.bench.idle_streams --streams 10000 --watch-s 20 --code /work/main
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import redis.asyncio as aioredis

from shared import events
from shared.events import TokenEvent
from shared.keys import Keys, event_id
from tests.procs import Cluster, RedisServer
from worker.sim import SimEngine

MAX_STREAMS = 15_000
"""Each stream is a socket on both sides; the box's RLIMIT_NOFILE hard limit is 20,000."""
MAX_WATCH_S = 120.0
SUBMITTERS = 64
CONNECTORS = 256
"""Streams being opened at once (the gateway's listen backlog takes the rest in turn)."""
SPARE_FDS = 1000
PREFIX = "genqidle:"
CHECKOUT = Path(__file__).resolve().parents[2]
MARKER = b"id: 2\n"
"""The frame of the event published during the drop."""


def raise_fd_limit(need: int) -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; the gateway child inherits it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, need)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < need:
        raise SystemExit(f"need {need} file descriptors, RLIMIT_NOFILE allows {want}")
    return want


class Stream:
    """One SSE client on a raw socket: it counts bytes and notes when `MARKER` arrived."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.opened = asyncio.Event()
        self.marked_at: float | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def run(self, host: str, port: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            reader, self.writer = await asyncio.open_connection(host, port)
            request = f"GET /v1/jobs/{self.job_id}/events HTTP/1.1\r\nHost: genq\r\n\r\n"
            self.writer.write(request.encode())
            tail = b""
            while not self.opened.is_set():  # headers and the replayed `queued` event
                chunk = await reader.read(65536)
                if not chunk:
                    raise ConnectionError(f"stream of {self.job_id} closed while opening")
                tail += chunk
                if b"id: 1\n" in tail:
                    self.opened.set()
        tail = tail[-len(MARKER) :]
        while chunk := await reader.read(65536):
            if self.marked_at is None and MARKER in tail + chunk:
                self.marked_at = time.perf_counter()
            tail = (tail + chunk)[-len(MARKER) :]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def gateway_cpu_s(pid: int) -> float:
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


async def commands(admin: aioredis.Redis) -> int:
    return int((await admin.info("stats"))["total_commands_processed"])


async def command_calls(admin: aioredis.Redis) -> dict[str, int]:
    stats = await admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def busiest(before: dict[str, int], after: dict[str, int], seconds: float) -> dict[str, float]:
    """Commands/s by command, the five most frequent."""
    rates = {c: (n - before.get(c, 0)) / seconds for c, n in after.items()}
    top = sorted(rates.items(), key=lambda kv: -kv[1])[:5]
    return {c: round(r, 1) for c, r in top if r > 0}


async def submit_jobs(url: str, n: int) -> list[str]:
    ids: list[str] = []
    todo = iter(range(n))
    body = {"model": "sim", "prompt": "wait", "max_tokens": 8, "priority": "batch"}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def submitter() -> None:
            for _ in todo:
                r = await client.post("/v1/jobs", json=body)
                r.raise_for_status()
                ids.append(r.json()["id"])

        await asyncio.gather(*(submitter() for _ in range(SUBMITTERS)))
    return ids


async def write_card(admin: aioredis.Redis, keys: Keys) -> None:
    """The sim model's card as a worker writes it: the gateway accepts its jobs."""
    engine = SimEngine()
    card = {"card": engine.card.model_dump_json(), "tokenizer": engine.tokenizer_json}
    await admin.hset(keys.model_card(engine.card.name), mapping=card)  # type: ignore[misc,arg-type]
    await admin.sadd(keys.models(), engine.card.name)  # type: ignore[misc]


def drop_pubsub(admin: aioredis.Redis, keys: Keys, ids: list[str]) -> aioredis.client.Pipeline:
    """A MULTI that kills the gateway's pub/sub connection and, before it can subscribe again,
    logs and publishes seq 2 to every job. Its replies: (connections killed, then for each
    job the XADD's and the PUBLISH's, the subscribers it reached)."""
    pipe = admin.pipeline(transaction=True)
    pipe.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    data = events.encode(TokenEvent(seq=2, text=" x", token_ids=[7], count=1))
    for job_id in ids:
        pipe.xadd(keys.events(job_id), {"d": data}, id=event_id(2))
        pipe.publish(keys.channel(job_id), data)
    return pipe


async def watch_idle(admin: aioredis.Redis, pid: int, seconds: float) -> dict[str, object]:
    """Redis commands/s and the gateway's CPU while nothing happens."""
    by0 = await command_calls(admin)
    c0, cpu0, t0 = await commands(admin), gateway_cpu_s(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    c1, cpu1, t1 = await commands(admin), gateway_cpu_s(pid), time.perf_counter()
    by1 = await command_calls(admin)
    watch = t1 - t0
    return {
        "watch_s": round(watch, 2),
        "redis_commands_per_s": round((c1 - c0 - 1) / watch, 1),  # less the first INFO
        "gateway_cpu_pct": round((cpu1 - cpu0) / watch * 100, 2),
        "busiest_commands_per_s": busiest(by0, by1, watch),
    }


async def recover(
    admin: aioredis.Redis, keys: Keys, streams: list[Stream], timeout_s: float
) -> dict[str, object]:
    """The drop, then the time until every client has the event published during it."""
    ids = [s.job_id for s in streams]
    drop = drop_pubsub(admin, keys, ids)
    c0 = await commands(admin)
    t_drop = time.perf_counter()
    killed, *replies = await drop.execute()
    deadline = t_drop + timeout_s
    while time.perf_counter() < deadline and any(s.marked_at is None for s in streams):
        await asyncio.sleep(0.01)
    got = sorted(s.marked_at - t_drop for s in streams if s.marked_at is not None)
    c1 = await commands(admin)
    everyone = len(got) == len(streams)
    return {
        "pubsub_connections_killed": killed,
        "publishes_heard": sum(int(r) for r in replies[1::2]),
        "caught_up": len(got),
        "recovery_s": round(got[-1], 3) if everyone else None,
        "median_s": round(got[len(got) // 2], 3) if got else None,
        # less the bench's own: INFO, MULTI, CLIENT KILL, an XADD and a PUBLISH a job, EXEC
        "redis_commands": c1 - c0 - 1 - (2 * len(ids) + 3),
    }


async def bench(a: argparse.Namespace, code: Path) -> dict[str, object]:
    keys = Keys(PREFIX)
    with tempfile.TemporaryDirectory(prefix="genq-idle-") as tmp:
        server = RedisServer(Path(tmp), args=("--appendonly", "no"))
        server.start()
        env = {
            "GENQ_LOG_LEVEL": "INFO",
            "GENQ_ACCESS_LOG": "false",
            "GENQ_SSE_KEEPALIVE_S": str(a.keepalive_s),
            "PYTHONPATH": str(code),
        }
        cluster = Cluster(server.url, Path(tmp), PREFIX, **env)
        admin = aioredis.Redis.from_url(server.url, decode_responses=True)
        streams: list[Stream] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            await write_card(admin, keys)
            os.chdir(code)  # `python -m genq` imports from its working directory first
            gateway = cluster.gateway()
            streams = [Stream(j) for j in await submit_jobs(gateway.url, a.streams)]
            gate = asyncio.Semaphore(CONNECTORS)
            t0 = time.perf_counter()
            port = gateway.port or 0
            tasks = [asyncio.create_task(s.run("127.0.0.1", port, gate)) for s in streams]
            opened = asyncio.gather(*(s.opened.wait() for s in streams))
            with contextlib.suppress(TimeoutError):  # measured with those open by then
                await asyncio.wait_for(opened, a.open_timeout_s)
            open_s = time.perf_counter() - t0
            ready = [s for s in streams if s.opened.is_set()]
            await asyncio.sleep(a.settle_s)  # checks woken by late SUBSCRIBE confirmations
            idle = await watch_idle(admin, gateway.proc.pid, a.watch_s)
            closed = sum(t.done() for t in tasks)
            drop = await recover(admin, keys, ready, a.recover_timeout_s)
            says = [line[:300] for line in gateway.output().splitlines() if "pub/sub" in line]
            return {
                "code": str(code),
                "streams": len(streams),
                "opened": len(ready),
                "open_s": round(open_s, 2),
                **idle,
                "streams_closed_while_idle": closed,
                "drop": {**drop, "gateway_says": says},
            }
        finally:
            for s in streams:
                s.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await admin.aclose()
            for p in cluster.procs:
                p.kill()
            server.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=10_000, help=f"idle streams (≤ {MAX_STREAMS})")
    p.add_argument("--watch-s", type=float, default=20.0, help=f"idle window (≤ {MAX_WATCH_S})")
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after opening, before it")
    p.add_argument("--keepalive-s", type=float, default=15.0, help="GENQ_SSE_KEEPALIVE_S")
    p.add_argument(
        "--open-timeout-s", type=float, default=180.0, help="then measure those open by then"
    )
    p.add_argument("--recover-timeout-s", type=float, default=60.0)
    p.add_argument("--code", help="checkout whose gateway runs (PYTHONPATH); default: this one")
    a = p.parse_args()
    if not 1 <= a.streams <= MAX_STREAMS or not 0 < a.watch_s <= MAX_WATCH_S:
        p.error(f"--streams 1..{MAX_STREAMS}, --watch-s up to {MAX_WATCH_S}")
    raise_fd_limit(a.streams + SPARE_FDS)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    code = Path(a.code).resolve() if a.code else CHECKOUT
    print(json.dumps(asyncio.run(bench(a, code)), indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
