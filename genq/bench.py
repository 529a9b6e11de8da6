"""`genq bench`: a load generator of concurrent streaming clients.

Each client runs requests back to back over a raw asyncio HTTP/1.1 connection (TLS for
`https://` URLs), so the load generator itself stays cheap next to the system it measures.
`--api` picks the route: `native` streams `POST /v1/jobs`, `openai` the completions route
(`/v1/completions`) and `chat` the chat route (`/v1/chat/completions`), both with
`stream_options.include_usage`. Figures: requests/s, tokens/s delivered, time to first token
and inter-token latency (p50, p99), errors; plus the gateway's open streams and memory,
sampled from /readyz. On a terminal (and without --json) a progress bar shows finished
requests, elapsed time, rate and ETA.

Inter-token latency: a native token event says how many tokens it carries, and its gap is
divided among them. An OpenAI chunk does not say: the stream's tokens are those of its usage
chunk, and each chunk's gap is divided by the stream's average tokens per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from tqdm import tqdm

from genq.client import api_key
from genq.stats import TokenTimes, latency
from shared import runtime

_WORDS = "the of and to in is that for it as was with be by on not this are or from at".split()
_READYZ_EVERY_S = 0.5
LATENCY_DIGITS = 2
"""Milliseconds are reported to this many decimals."""
DEFAULT_PORTS = {"http": 80, "https": 443}
API_PATHS = {
    "native": "/v1/jobs",
    "openai": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
}
ERROR_TEXT_CHARS = 200


@dataclass
class Result:
    times: TokenTimes = field(default_factory=lambda: TokenTimes(time.perf_counter()))
    ok: bool = False
    error: str = ""

    @property
    def tokens(self) -> int:
        return self.times.tokens


@dataclass
class Target:
    host: str
    port: int
    api_key: str | None
    tls: ssl.SSLContext | None = None

    @classmethod
    def from_url(cls, url: str, api_key: str | None) -> Target:
        """`http://` or `https://` (verified against the system's CA store, or the file in
        SSL_CERT_FILE); ValueError for any other scheme."""
        parts = urlsplit(url)
        if parts.scheme not in DEFAULT_PORTS:
            raise ValueError(f"--url must start with http:// or https://, not {url!r}")
        tls = ssl.create_default_context() if parts.scheme == "https" else None
        port = parts.port or DEFAULT_PORTS[parts.scheme]
        return cls(parts.hostname or "127.0.0.1", port, api_key, tls)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.tls is None:
            return await asyncio.open_connection(self.host, self.port)
        return await asyncio.open_connection(
            self.host, self.port, ssl=self.tls, server_hostname=self.host
        )

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


class Stream(Protocol):
    """Reads one response's SSE frames into its Result."""

    def frame(self, frame: bytes, now: float) -> None: ...

    def end(self) -> None: ...


def _data(frame: bytes) -> bytes:
    return frame.split(b"data: ", 1)[1] if b"data: " in frame else b""


class NativeStream:
    """genq's own events: `token` (with its token count), `done`, `error`, `cancelled`."""

    def __init__(self, res: Result) -> None:
        self.res = res

    def frame(self, frame: bytes, now: float) -> None:
        etype = frame.split(b"event: ", 1)[1].split(b"\n", 1)[0] if b"event: " in frame else b""
        if etype == b"token":
            self.res.times.arrived(now, int(json.loads(_data(frame))["count"]))
        elif etype == b"done":
            self.res.ok = True
        elif etype in (b"error", b"cancelled"):
            self.res.error = _data(frame)[:ERROR_TEXT_CHARS].decode(errors="replace")

    def end(self) -> None:
        pass


class OpenAIStream:
    """OpenAI's chunks (completions: `choices[].text`; chat: `choices[].delta.content`), the
    usage chunk, then `[DONE]`; an `error` object ends it."""

    def __init__(self, res: Result) -> None:
        self.res = res
        self.finished = False
        self.done = False
        self.usage_tokens: int | None = None

    def frame(self, frame: bytes, now: float) -> None:
        data = _data(frame)
        if not data:
            return
        if data == b"[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            self.res.error = json.dumps(chunk["error"])[:ERROR_TEXT_CHARS]
            return
        for choice in chunk.get("choices") or []:
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                self.res.times.arrived(now, 1)
            self.finished = self.finished or choice.get("finish_reason") is not None
        if chunk.get("usage"):
            self.usage_tokens = int(chunk["usage"]["completion_tokens"])

    def end(self) -> None:
        if self.res.error:
            return
        if not (self.finished and self.done):
            self.res.error = "the stream ended before its finish_reason and [DONE]"
            return
        self.res.ok = True
        if self.usage_tokens is not None:
            self.res.times.recount(self.usage_tokens)


class ResponsesStream:
    """The Responses API's events: `response.output_text.delta`, then `response.completed`
    (or `response.incomplete`: max_output_tokens reached) with the usage; `response.failed`
    or `response.cancelled` end it in error."""

    def __init__(self, res: Result) -> None:
        self.res = res
        self.ended = False

    def frame(self, frame: bytes, now: float) -> None:
        data = _data(frame)
        if not data:
            return
        event = json.loads(data)
        kind = event.get("type")
        if kind == "response.output_text.delta":
            self.res.times.arrived(now, 1)
        elif kind in ("response.completed", "response.incomplete"):
            self.ended = True
            usage = (event.get("response") or {}).get("usage")
            if usage:
                self.res.times.recount(int(usage["output_tokens"]))
        elif kind in ("response.failed", "response.cancelled", "error"):
            self.res.error = json.dumps(event)[:ERROR_TEXT_CHARS]

    def end(self) -> None:
        if self.res.error:
            return
        if not self.ended:
            self.res.error = "the stream ended before response.completed"
            return
        self.res.ok = True


STREAMS: dict[str, type[NativeStream] | type[OpenAIStream] | type[ResponsesStream]] = {
    "native": NativeStream,
    "openai": OpenAIStream,
    "chat": OpenAIStream,
    "responses": ResponsesStream,
}


class Client:
    """One keep-alive connection running requests back to back."""

    def __init__(self, target: Target, api: str = "native") -> None:
        self.target = target
        self.path = API_PATHS[api]
        self.stream_cls = STREAMS[api]
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.conn is None:
            self.conn = await self.target.connect()
        return self.conn

    async def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None

    async def stream_job(self, body: bytes) -> Result:
        res = Result()
        try:
            reader, writer = await self._connection()
            res.times.start = time.perf_counter()
            writer.write(self.target.request("POST", self.path, body))
            status, headers = await _read_head(reader)
            stream = self.stream_cls(res)
            buf = b""
            async for chunk in _body_chunks(reader, headers):
                if status >= 400:
                    res.error = (
                        f"HTTP {status}: {chunk[:ERROR_TEXT_CHARS].decode(errors='replace')}"
                    )
                    continue
                now = time.perf_counter()
                buf += chunk
                *frames, buf = buf.split(b"\n\n")
                for frame in frames:
                    if not frame.startswith(b":"):  # a comment: keep-alive
                        stream.frame(frame, now)
            if status < 400:
                stream.end()
            if headers.get("connection", "").lower() == "close":
                await self.close()
        except (OSError, asyncio.IncompleteReadError, ValueError, KeyError) as exc:
            res.ok = False
            res.error = f"{type(exc).__name__}: {exc}"
            await self.close()
        return res


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


def request_body(api: str, args: argparse.Namespace, prompt: str, seed: int) -> bytes:
    """One request of the workload on route `api`."""
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "stream": True,
        "seed": seed,
    }
    if api == "responses":
        del body["max_tokens"]
        body |= {"input": prompt, "max_output_tokens": args.max_tokens}
    elif api == "native":
        body |= {"prompt": prompt, "priority": args.priority}
    else:
        body["stream_options"] = {"include_usage": True}
        if api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
    schema = getattr(args, "schema", None)
    if schema is not None:
        if api == "responses":
            body["text"] = {"format": {"type": "json_schema", "name": "bench", "schema": schema}}
        elif api == "chat":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": schema},
            }
        else:
            body["json_schema"] = schema
    return json.dumps(body).encode()


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    target = Target.from_url(args.url, api_key(args))
    api = getattr(args, "api", "native")
    if getattr(args, "json_schema", None):
        args.schema = json.loads(await asyncio.to_thread(Path(args.json_schema).read_text))
    rng = random.Random(0)
    bodies = [
        request_body(api, args, _prompt(args.prompt_tokens, rng), i) for i in range(args.requests)
    ]
    results: list[Result] = []
    todo = iter(bodies)
    bar = tqdm(
        total=args.requests,
        unit="req",
        file=sys.stderr,
        disable=args.json or not sys.stderr.isatty(),
        dynamic_ncols=True,
    )

    async def client_loop() -> None:
        client = Client(target, api)
        for body in todo:
            res = await client.stream_job(body)
            results.append(res)
            bar.update(1)
            if not res.ok:
                bar.set_postfix(errors=sum(not r.ok for r in results), refresh=False)
        await client.close()

    peak: dict[str, float] = {}
    stop = asyncio.Event()
    sampler = asyncio.create_task(_readyz(target, peak, stop))
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client_loop() for _ in range(min(args.concurrency, args.requests))))
    finally:
        wall = time.perf_counter() - t0
        bar.close()
        stop.set()
        await sampler
    return _summary(args, api, results, wall, peak)


def _summary(
    args: argparse.Namespace, api: str, results: list[Result], wall: float, peak: dict[str, Any]
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "url": args.url,
        "model": args.model,
        "api": api,
        "concurrency": args.concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        **latency([r.times for r in ok], LATENCY_DIGITS),
        "gateway_peak_streams": peak.get("streams"),
        "gateway_peak_rss_mb": peak.get("rss_mb"),
    }


def main(args: argparse.Namespace) -> int:
    try:
        Target.from_url(args.url, api_key(args))
    except ValueError as exc:
        print(f"genq bench: {exc}", file=sys.stderr)
        return 2
    summary = runtime.run(run_bench(args))
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            if v is not None:  # no error, or no /readyz figures: nothing to show
                print(f"{k:>22}: {v}")
    return 0 if summary["errors"] == 0 else 1
