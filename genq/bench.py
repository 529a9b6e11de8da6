"""`genq bench`: a load generator of concurrent streaming clients.

Each client runs requests back to back (`POST /v1/jobs` with `"stream": true`) over a raw
asyncio HTTP/1.1 connection, so the load generator itself stays cheap next to the system it
measures. Figures: requests/s, tokens/s delivered, time to first token and inter-token
latency (p50, p99), errors; plus the gateway's open streams and memory, sampled from /readyz.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shared import runtime

_WORDS = "the of and to in is that for it as was with be by on not this are or from at".split()
_READYZ_EVERY_S = 0.5


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    """Inter-token latency samples: each token event's gap divided among its tokens."""


@dataclass
class Target:
    host: str
    port: int
    api_key: str | None

    def request(self, method: str, path: str, body: bytes = b"") -> bytes:
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Accept: text/event-stream\r\nConnection: keep-alive\r\n\r\n"
        )
        return head.encode() + body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ": " in line:
            k, v = line.split(": ", 1)
            headers[k.lower()] = v
    return status, headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]):  # type: ignore[no-untyped-def]
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]
    else:
        yield await reader.readexactly(int(headers.get("content-length", "0")))


class Client:
    """One keep-alive connection running requests back to back."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.target.host, self.target.port)
        return self.conn

    async def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None

    async def stream_job(self, body: bytes) -> Result:
        res = Result()
        try:
            reader, writer = await self._connection()
            t0 = time.perf_counter()
            writer.write(self.target.request("POST", "/v1/jobs", body))
            status, headers = await _read_head(reader)
            buf = b""
            last = t0
            async for chunk in _body_chunks(reader, headers):
                if status >= 400:
                    res.error = f"HTTP {status}: {chunk[:200].decode(errors='replace')}"
                    continue
                now = time.perf_counter()
                buf += chunk
                *frames, buf = buf.split(b"\n\n")
                for frame in frames:
                    last = self._frame(res, frame, t0, last, now)
            if headers.get("connection", "").lower() == "close":
                await self.close()
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            await self.close()
        return res

    @staticmethod
    def _frame(res: Result, frame: bytes, t0: float, last: float, now: float) -> float:
        if frame.startswith(b":"):
            return last
        etype = frame.split(b"event: ", 1)[1].split(b"\n", 1)[0] if b"event: " in frame else b""
        if etype == b"token":
            count = json.loads(frame.split(b"data: ", 1)[1])["count"]
            if res.ttft is None:
                res.ttft = now - t0
            else:
                res.gaps.extend([(now - last) / count] * count)
            res.tokens += count
            return now
        if etype == b"done":
            res.ok = True
        elif etype in (b"error", b"cancelled"):
            res.error = frame.split(b"data: ", 1)[-1][:200].decode(errors="replace")
        return last


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


async def _readyz(target: Target, peak: dict[str, float], stop: asyncio.Event) -> None:
    client = Client(target)
    while not stop.is_set():
        try:
            reader, writer = await client._connection()
            writer.write(target.request("GET", "/readyz"))
            _, headers = await _read_head(reader)
            async for chunk in _body_chunks(reader, headers):
                data = json.loads(chunk)
                for k in ("streams", "rss_mb"):
                    if k in data:
                        peak[k] = max(peak.get(k, 0), data[k])
        except (OSError, asyncio.IncompleteReadError, ValueError):
            await client.close()
        try:
            await asyncio.wait_for(stop.wait(), _READYZ_EVERY_S)
        except TimeoutError:
            pass
    await client.close()


def _prompt(n_tokens: int, rng: random.Random) -> str:
    return "".join(" " + rng.choice(_WORDS) for _ in range(n_tokens)).lstrip()


async def run_bench(args: argparse.Namespace) -> dict:
    url = urlsplit(args.url)
    target = Target(url.hostname or "127.0.0.1", url.port or 80, args.api_key)
    rng = random.Random(0)
    bodies = [
        json.dumps(
            {
                "model": args.model,
                "prompt": _prompt(args.prompt_tokens, rng),
                "max_tokens": args.max_tokens,
                "priority": args.priority,
                "stream": True,
                "seed": i,
            }
        ).encode()
        for i in range(args.requests)
    ]
    results: list[Result] = []
    todo = iter(bodies)
    show = sys.stderr.isatty() and not args.json

    async def client_loop() -> None:
        client = Client(target)
        for body in todo:
            results.append(await client.stream_job(body))
            if show:
                _progress(len(results), args.requests)
        await client.close()

    peak: dict[str, float] = {}
    stop = asyncio.Event()
    sampler = asyncio.create_task(_readyz(target, peak, stop))
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(args.concurrency, args.requests))))
    wall = time.perf_counter() - t0
    stop.set()
    await sampler
    if show:
        sys.stderr.write("\n")
    return _summary(args, results, wall, peak)


def _summary(args: argparse.Namespace, results: list[Result], wall: float, peak: dict) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    errors = [r.error for r in results if not r.ok]
    return {
        "url": args.url,
        "model": args.model,
        "concurrency": args.concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 2),
        "tokens": sum(r.tokens for r in ok),
        "tokens_per_s": round(sum(r.tokens for r in ok) / wall, 1),
        "ttft_ms_p50": ms(percentile(ttfts, 50)),
        "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "itl_ms_p50": ms(percentile(gaps, 50)),
        "itl_ms_p99": ms(percentile(gaps, 99)),
        "gateway_peak_streams": peak.get("streams"),
        "gateway_peak_rss_mb": peak.get("rss_mb"),
    }


def _progress(done: int, total: int) -> None:
    width = 40
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    sys.stderr.flush()


def main(args: argparse.Namespace) -> int:
    summary = runtime.run(run_bench(args))
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>22}: {v}")
    return 0 if summary["errors"] == 0 else 1
