"""What the access log costs at a high request rate: two `genq gateway` processes side by side,
one with GENQ_ACCESS_LOG on and one with it off, their JSON lines going to a file as under
systemd or Kubernetes; a closed loop of keep-alive connections hammers a cheap route on each
in turn (rounds interleaved so the box's load falls on both alike). Prints, per round and mode:
requests/s, the gateway's CPU per request, and the log bytes per request.

    python -m tests.bench.access_log --requests 20000 --concurrency 32 --rounds 3 [--path /healthz]
    python -m tests.bench.access_log --in-process --requests 20000 --rounds 3

`--path /v1/jobs/<32 hex digits>` costs a Redis read per request (an unknown job: a 404 in
the API's error shape), as a client polling its job does; /healthz is the cheapest route, where
the line weighs most.

A raw asyncio HTTP/1.1 client, not httpx: on a 2-core box the client must cost far less than
the server it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import logging.config
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from genq.procstats import cpu_seconds
from tests.conftest import REDIS_URL
from tests.procs import free_port, wait_for

MODES = {"on": "true", "off": "false"}


def start_gateway(tmp: Path, mode: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = free_port()
    log = tmp / f"gateway-{mode}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    env.update(
        GENQ_REDIS_URL=REDIS_URL,
        GENQ_KEY_PREFIX=f"genqbench:{uuid.uuid4().hex[:8]}:",
        GENQ_ACCESS_LOG=MODES[mode],
        GENQ_LOG_FORMAT="json",
        GENQ_BATCH_LOOPS="false",
    )
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "gateway", "--port", str(port), "--workers", "1"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    wait_for(
        lambda: httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200,
        what=f"gateway ({mode})",
    )
    return proc, port, log


async def _connection(port: int, request: bytes, count: int) -> None:
    """`count` requests one after another on one keep-alive connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(count):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 "):
                raise RuntimeError(head.decode(errors="replace"))
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
    finally:
        writer.close()


async def load(port: int, path: str, requests: int, concurrency: int) -> float:
    """Seconds to serve `requests` GETs of `path` over `concurrency` connections."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    per = requests // concurrency
    t0 = time.perf_counter()
    await asyncio.gather(*(_connection(port, request, per) for _ in range(concurrency)))
    return time.perf_counter() - t0


def measure(a: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="genq-bench-access-") as tmp:
        gateways = {m: start_gateway(Path(tmp), m) for m in MODES}
        try:
            for _, port, _ in gateways.values():  # warm up: imports, first connections
                asyncio.run(load(port, a.path, a.concurrency * 20, a.concurrency))
            for rnd in range(a.rounds):
                order = list(MODES) if rnd % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    proc, port, log = gateways[mode]
                    cpu0, bytes0 = cpu_seconds(proc.pid), log.stat().st_size
                    wall = asyncio.run(load(port, a.path, a.requests, a.concurrency))
                    done = a.requests // a.concurrency * a.concurrency
                    cpu = cpu_seconds(proc.pid) - cpu0
                    rows.append(
                        {
                            "round": rnd + 1,
                            "access_log": mode,
                            "requests": done,
                            "requests_per_s": round(done / wall),
                            "gateway_cpu_us_per_request": round(cpu / done * 1e6, 1),
                            "log_bytes_per_request": round((log.stat().st_size - bytes0) / done),
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            for proc, _, _ in gateways.values():
                proc.terminate()
                proc.wait(15)
    return rows


async def _in_process(app: Any, path: str, requests: int) -> float:
    """Microseconds per request of the app called directly (no server, no socket)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    t0 = time.perf_counter()
    for _ in range(requests):
        await app(dict(scope), receive, send)
    return (time.perf_counter() - t0) / requests * 1e6


def in_process(a: argparse.Namespace) -> None:
    """The gateway app without a server or Redis (only routes that need neither, as
    /healthz), its JSON lines to a file: what the middleware and the line cost alone."""
    from gateway.app import create_app
    from shared import logs
    from shared.settings import GatewaySettings

    with (
        tempfile.TemporaryDirectory(prefix="genq-bench-access-") as tmp,
        open(Path(tmp) / "lines.jsonl", "w") as out,
    ):
        config = logs.log_config(GatewaySettings(log_format="json"))
        config["handlers"]["stderr"]["stream"] = out
        logging.config.dictConfig(config)
        for rnd in range(a.rounds):
            for mode in MODES:
                settings = GatewaySettings(
                    redis_url="redis://127.0.0.1:1/0", access_log=mode == "on"
                )
                app = create_app(settings)
                app.middleware_stack = app.build_middleware_stack()
                us = asyncio.run(_in_process(app, a.path, a.requests))
                row = {"round": rnd + 1, "access_log": mode, "us_per_request": round(us, 1)}
                print(json.dumps(row), flush=True)


def summary(rows: list[dict[str, object]]) -> None:
    for mode in MODES:
        mine = [r for r in rows if r["access_log"] == mode]
        rps = [float(r["requests_per_s"]) for r in mine]  # type: ignore[arg-type]
        cpu = [float(r["gateway_cpu_us_per_request"]) for r in mine]  # type: ignore[arg-type]
        print(
            f"access log {mode:>3}: {statistics.median(rps):,.0f} requests/s median "
            f"({min(rps):,.0f}-{max(rps):,.0f}), gateway CPU {statistics.median(cpu):.0f} "
            f"us/request median ({min(cpu):.0f}-{max(cpu):.0f})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--path", default="/healthz")
    p.add_argument(
        "--in-process", action="store_true", help="call the app directly: no server, no Redis"
    )
    a = p.parse_args()
    if a.in_process:
        in_process(a)
    else:
        summary(measure(a))


if __name__ == "__main__":
    main()
