"""What a hostile body costs the gateway's event loop: each refused request's time in the
gateway app (in-process, the Redis of GENQ_TEST_REDIS_URL, no worker), with the raw-body scan
(gateway/body_scan.py) and without it, side by side in one run.

    python -m tests.bench.heavy_bodies [--runs 3]

Bodies: a chat of 200,000 messages (7 MB: 422, over the 10,000-message limit), and a prompt of
5,000,000 token ids (14 MB: 400, no room in the sim model's 8,192-token context) on the native
`/v1/jobs` and on `/v1/completions`. Each figure is one request, body already encoded, from
send to answer: the time the gateway's loop spent on it, as nothing else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator

import redis.asyncio as aioredis

from gateway import body_scan
from shared.settings import Settings
from tests.conftest import REDIS_URL, gateway_only

BODIES = {
    "chat, 200,000 messages": (
        "/v1/chat/completions",
        {"model": "sim", "messages": [{"role": "user", "content": "hi"}] * 200_000},
    ),
    "/v1/jobs, 5,000,000 ids": ("/v1/jobs", {"model": "sim", "input_ids": [1] * 5_000_000}),
    "/v1/completions, 5,000,000 ids": (
        "/v1/completions",
        {"model": "sim", "prompt": [1] * 5_000_000, "max_tokens": 4},
    ),
}


@contextlib.contextmanager
def scan_off() -> Iterator[None]:
    """The routes as they were before the scan: every body goes to the full parse."""
    count, room = body_scan.Counter.first_too_long, body_scan.check_room

    async def no_room_check(*_: object) -> None:
        return None

    body_scan.Counter.first_too_long = lambda *_: None  # type: ignore[method-assign]
    body_scan.check_room = no_room_check  # type: ignore[assignment]
    try:
        yield
    finally:
        body_scan.Counter.first_too_long = count  # type: ignore[method-assign]
        body_scan.check_room = room


async def measure(runs: int) -> dict[str, dict[str, list[float]]]:
    settings = Settings(redis_url=REDIS_URL, key_prefix="genqbenchheavy:", access_log=False)
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    out: dict[str, dict[str, list[float]]] = {}
    try:
        async with gateway_only(settings, redis) as client:
            headers = {"content-type": "application/json"}
            for name, (path, body) in BODIES.items():
                raw = json.dumps(body).encode()
                row = out.setdefault(name, {"scan": [], "no scan": [], "status": []})
                for _ in range(runs):
                    for mode in ("scan", "no scan"):
                        with scan_off() if mode == "no scan" else contextlib.nullcontext():
                            t = time.perf_counter()
                            r = await client.post(path, content=raw, headers=headers)
                            row[mode].append(time.perf_counter() - t)
                        row["status"].append(r.status_code)
    finally:
        await redis.aclose()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.heavy_bodies", description=__doc__)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args(argv)
    rows = asyncio.run(measure(a.runs))
    print(f"{'body':34} {'status':>8} {'scan s (median)':>16} {'no scan s':>10} {'ratio':>6}")
    for name, row in rows.items():
        scan, full = statistics.median(row["scan"]), statistics.median(row["no scan"])
        statuses = "/".join(str(s) for s in sorted(set(row["status"])))
        print(f"{name:34} {statuses:>8} {scan:16.3f} {full:10.3f} {full / scan:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
