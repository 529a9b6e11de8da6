"""What the chaos tests and the recovery benchmark share: a resuming SSE client, reference text,
stream checks, and polling helpers that wait on conditions (never fixed sleeps).

A client here behaves like a careful production client: it submits with an Idempotency-Key
(so a retried POST cannot queue a second job), and when its stream breaks before a final
event it reconnects, to whichever gateway answers, with `Last-Event-ID`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis.exceptions import RedisError

from shared.events import FINAL_EVENT_TYPES
from shared.schemas import Sampling
from worker.engine import EngineJob
from worker.sim import SimEngine, build_tokenizer

# Test timing: short leases so a dead worker's jobs move within about a second.
FAST_LEASES = {
    "GENQ_LEASE_S": "1",
    "GENQ_HEARTBEAT_S": "0.2",
    "GENQ_CLAIM_BLOCK_MS": "200",
    "GENQ_STREAM_IDLE_POLL_S": "0.5",
    "GENQ_REDIS_RETRIES": "3",
}
RECONNECT_PAUSE_S = 0.1
POLL_S = 0.05


@dataclass
class Accepted:
    job_id: str
    sent: float
    """time.monotonic() when the POST that was accepted went out."""
    at: float
    """... and of its 2xx."""


async def submit(
    http: httpx.AsyncClient, url: str, body: dict, *, retry_5xx: bool = True
) -> Accepted:
    """POST until accepted, the same Idempotency-Key every time: a client's retry after a
    dropped connection or (`retry_5xx`, as while Redis fails over) a 5xx, which the key makes
    safe (the job is queued once)."""
    key = uuid.uuid4().hex
    while True:
        sent = time.monotonic()
        try:
            r = await http.post(f"{url}/v1/jobs", json=body, headers={"Idempotency-Key": key})
            if r.status_code < 500 or not retry_5xx:  # 200: a retry the earlier POST queued
                assert r.status_code in (200, 202), r.text
                return Accepted(str(r.json()["id"]), sent, time.monotonic())
        except httpx.TransportError:
            pass
        await asyncio.sleep(RECONNECT_PAUSE_S)


@dataclass
class Event:
    seq: int
    type: str
    data: dict[str, Any]
    at: float
    """time.monotonic() when the client read it."""


@dataclass
class Stream:
    """What one client saw of one job."""

    body: dict[str, Any]
    job_id: str | None = None
    events: list[Event] = field(default_factory=list)
    reconnects: int = 0

    @property
    def last_seq(self) -> int:
        return self.events[-1].seq if self.events else 0

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].type in FINAL_EVENT_TYPES

    @property
    def text(self) -> str:
        return "".join(e.data["text"] for e in self.events if e.type == "token")

    def tokens(self) -> int:
        return sum(e.data["count"] for e in self.events if e.type == "token")


async def follow(
    client: httpx.AsyncClient, gateways: Callable[[], Sequence[str]], stream: Stream
) -> Stream:
    """Submit `stream.body` (streaming) and read the job's events to the end, resuming with
    Last-Event-ID on another gateway whenever the connection breaks."""
    key = uuid.uuid4().hex
    attempt = 0
    while not stream.finished:
        urls = gateways()
        url = urls[attempt % len(urls)]
        attempt += 1
        try:
            if stream.job_id is None:
                request = client.build_request(
                    "POST",
                    f"{url}/v1/jobs",
                    json={**stream.body, "stream": True},
                    headers={"Idempotency-Key": key},
                )
            else:
                request = client.build_request(
                    "GET",
                    f"{url}/v1/jobs/{stream.job_id}/events",
                    headers={"Last-Event-ID": str(stream.last_seq)},
                )
            response = await client.send(request, stream=True)
            try:
                if response.status_code >= 500:
                    raise httpx.TransportError(f"{response.status_code} from {url}")
                assert response.status_code in (200, 202), await response.aread()
                stream.job_id = response.headers["x-job-id"]
                await _read_frames(response, stream)
            finally:
                await response.aclose()
        except (httpx.TransportError, httpx.StreamError):
            pass
        if not stream.finished:
            stream.reconnects += 1
            await asyncio.sleep(RECONNECT_PAUSE_S)
    return stream


async def _read_frames(response: httpx.Response, stream: Stream) -> None:
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line:
            if not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
            continue
        if "data" in fields:
            stream.events.append(
                Event(
                    int(fields["id"]), fields["event"], json.loads(fields["data"]), time.monotonic()
                )
            )
            if stream.finished:
                return
        fields = {}


class Reference:
    """What an undisturbed run gives: the sim engine in-process, no delays."""

    def __init__(self) -> None:
        self.tokenizer = build_tokenizer()
        self.engine = SimEngine(step_ms=0, prefill_ms_per_1k=0)

    def text(self, prompt: str, seed: int, max_tokens: int) -> str:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        job = EngineJob(uuid.uuid4().hex, ids, max_tokens, Sampling(seed=seed), seed)
        self.engine.add(job)
        parts: list[str] = []
        while self.engine.active():
            parts += [o.text for o in self.engine.step() if o.job_id == job.id]
        return "".join(parts)


def stream_faults(stream: Stream, reference: str, max_tokens: int) -> list[str]:
    """Everything wrong with a finished stream (empty when it is exactly right)."""
    faults = []
    seqs = [e.seq for e in stream.events]
    if seqs != list(range(1, len(seqs) + 1)):
        faults.append(f"seq not contiguous from 1: {seqs}")
    finals = [e for e in stream.events if e.type in FINAL_EVENT_TYPES]
    if len(finals) != 1 or finals[0].type != "done":
        faults.append(f"final events {[(e.type, e.data) for e in finals]}")
    elif finals[0].data["usage"]["completion_tokens"] != max_tokens:
        faults.append(f"usage {finals[0].data['usage']} != {max_tokens} tokens")
    if stream.tokens() != max_tokens:
        faults.append(f"{stream.tokens()} tokens streamed, not {max_tokens}")
    if stream.text != reference:
        faults.append(f"text differs from the reference run: {stream.text!r} != {reference!r}")
    return faults


def recovery_s(stream: Stream, killed_at: float) -> float | None:
    """Kill → first token of a later attempt, for a stream whose worker was killed."""
    before = [e.data["attempt"] for e in stream.events if e.type == "token" and e.at < killed_at]
    if not before:
        return None
    later = [e for e in stream.events if e.type == "token" and e.data["attempt"] > max(before)]
    return later[0].at - killed_at if later else None


async def until(
    predicate: Callable[[], Awaitable[bool]], limit_s: float, what: str, poll: float = POLL_S
) -> None:
    """Poll an async condition until it holds; fail after `limit_s` seconds. A poll that hits
    a connection error (Redis or a gateway is down on purpose) counts as "not yet"."""
    deadline = time.monotonic() + limit_s
    while not await _holds(predicate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit_s} s waiting for {what}")
        await asyncio.sleep(poll)


async def _holds(predicate: Callable[[], Awaitable[bool]]) -> bool:
    try:
        return await predicate()
    except (RedisError, httpx.TransportError, OSError):
        return False


def quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]
