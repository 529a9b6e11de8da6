"""Clients that do not read, with real processes: a `genq gateway`, a sim worker and a private
redis-server. Each client is a plain socket with a small receive buffer that sends its request
and then reads nothing (until the test says so), as a stuck or hostile client would.

What must hold: the gateway's memory stays bounded however much the jobs write, it is given
back when the sockets close, a client that reads late gets its whole stream exactly as the
job's log holds it, and a client that reads nothing at all is disconnected.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
import redis

from shared.keys import Keys
from tests.procs import Cluster, Proc, redis_server, wait_for

pytestmark = pytest.mark.e2e

PREFIX = "genqslow:"
KEYS = Keys(PREFIX)
RCVBUF = 4096
"""The clients' receive buffer: small, so the gateway's writes block soon."""
MiB = 1 << 20
BUFFER_BYTES = 64 * 1024
"""GENQ_STREAM_BUFFER_BYTES of the gateways under test."""
LONG_S = 600
"""A stall timeout no test reaches (where disconnecting is not what is tested)."""
NATIVE_STREAMS = 8
CHOICES = 16
MAX_TOKENS = 4000
LOGPROBS = 20
JOBS_DONE_S = 60.0
POLL_S = 0.05
ENDED = ("succeeded", "failed", "cancelled", "expired")
MIN_OUTPUT = 100 * MiB
MAX_GROWTH = 48 * MiB
"""The gateway's memory may grow this much for all the streams together: 24 streams, 64 KiB
buffers, 122 MiB of events through the gateway's pub/sub reader. Measured +8 to +25 MiB alone
and up to +33 MiB with three other test suites on the box's two cores (the allocator keeps
the high-water mark of the events passing through, not what any stream holds); the gateway
before the bound: +126 MiB while open, +512 MiB after."""
SMALL_BUFFER_BYTES = 16 * 1024
LONGEST = 8000
"""max_tokens of the longest job the sim model takes (its context is 8192)."""
STALL_S = 1.0
STEADY_STEP_MS = 2
"""Slow enough that a job outlives the time its client's socket takes to fill."""
DISCONNECT_S = 30.0
END_OF_BODY = b"0\r\n\r\n"
"""The last chunk of a chunked HTTP body."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    conf = tmp_path / "redis.conf"
    conf.write_text("appendonly no\n")  # megabytes of logs per second: no fsync per write
    with redis_server(conf) as server:
        c = Cluster(server.url, tmp_path, PREFIX, GENQ_CLAIM_BLOCK_MS="200")
        try:
            yield c
        finally:
            c.close()


@pytest.fixture
def db(cluster: Cluster) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def opened() -> Iterator[list[SilentClient]]:
    """Every SilentClient a test opens, closed after it whatever happened."""
    clients: list[SilentClient] = []
    yield clients
    for c in clients:
        c.close()


class SilentClient:
    """One HTTP request on a socket with a small receive buffer; nothing is read until
    `read_response`."""

    def __init__(
        self, gateway: Proc, path: str, body: dict[str, Any], opened: list[SilentClient]
    ) -> None:
        opened.append(self)
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self.sock.connect(("127.0.0.1", cast(int, gateway.port)))
        self.sock.sendall(head.encode() + payload)
        self.port: int = self.sock.getsockname()[1]

    def read_all(self, timeout: float = 60.0) -> bytes:
        """Everything the gateway sends, until it closes (or resets) the connection."""
        self.sock.settimeout(timeout)
        data = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := self.sock.recv(1 << 16):
                data += chunk
        return bytes(data)

    def read_response(self, timeout: float = 60.0) -> tuple[dict[str, str], bytes]:
        """Headers and (de-chunked) body, reading until the gateway closes."""
        head, _, body = self.read_all(timeout).partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")[1:]
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
        return headers, _dechunk(body)

    def close(self) -> None:
        self.sock.close()


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


def _rss(p: Proc) -> int:
    return int(psutil.Process(p.proc.pid).memory_info().rss)


def _job_ids(db: redis.Redis) -> list[str]:
    return [k.split("{")[1].rstrip("}") for k in db.scan_iter(match=KEYS.job("*"), count=1000)]


def _statuses(db: redis.Redis, job_ids: list[str]) -> list[str]:
    return [cast(str, db.hget(KEYS.job(j), "status")) for j in job_ids]


def _log(db: redis.Redis, job_id: str) -> list[tuple[int, str]]:
    """(seq, event JSON) of the job's whole log."""
    entries = cast(list[tuple[str, dict[str, str]]], db.xrange(KEYS.events(job_id)))
    return [(int(i.split("-")[1]), f["d"]) for i, f in entries]


def _kernel_send_buffer_max() -> int:
    """The most a socket's send buffer may grow to: what the kernel can hold for a client
    that does not read, before the gateway's own writes block."""
    return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])


def _native(i: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": "sim",
        "prompt": f"silent client {i}",
        "max_tokens": max_tokens,
        "logprobs": LOGPROBS,
        "seed": i,
        "stream": True,
    }


def _openai(n: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": "sim",
        "messages": [{"role": "user", "content": "a silent client"}],
        "max_tokens": max_tokens,
        "n": n,
        "logprobs": True,
        "top_logprobs": LOGPROBS,
        "stream": True,
    }


def _until_ended(db: redis.Redis, count: int, old: set[str], during: Any = None) -> list[str]:
    """Wait until `count` jobs (besides `old`) exist and all have ended; call `during()`
    while waiting. Their ids."""
    deadline = time.monotonic() + JOBS_DONE_S
    while time.monotonic() < deadline:
        if during is not None:
            during()
        ids = [j for j in _job_ids(db) if j not in old]
        if len(ids) >= count and all(s in ENDED for s in _statuses(db, ids)):
            return ids
        time.sleep(POLL_S)
    raise TimeoutError(f"jobs did not end: {_statuses(db, _job_ids(db))}")


def _connected(gateway: Proc, client: SilentClient) -> bool:
    """Whether the gateway holds a connection from this client."""
    conns = psutil.Process(gateway.proc.pid).net_connections(kind="tcp")
    return any(c.raddr and c.raddr.port == client.port for c in conns)


def _frames(body: bytes) -> list[tuple[str, str, str]]:
    """(id, event, data) of each SSE frame, the data as sent."""
    out = []
    for frame in body.decode().split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":")
        )
        if "data" in fields:
            out.append((fields.get("id", ""), fields.get("event", ""), fields["data"]))
    return out


def test_non_reading_clients_cost_the_gateway_bounded_memory_while_open_and_after_close(
    cluster: Cluster, db: redis.Redis, opened: list[SilentClient]
) -> None:
    gateway = cluster.gateway(
        GENQ_STREAM_BUFFER_BYTES=str(BUFFER_BYTES), GENQ_STREAM_STALL_TIMEOUT_S=str(LONG_S)
    )
    cluster.worker("--step-ms", "0")
    warm = SilentClient(gateway, "/v1/chat/completions", _openai(2, max_tokens=50), opened)
    warm.read_response()  # every code path once, before the baseline
    old = set(_job_ids(db))
    baseline = _rss(gateway)
    clients = [SilentClient(gateway, "/v1/jobs", _native(i), opened) for i in range(NATIVE_STREAMS)]
    clients.append(SilentClient(gateway, "/v1/chat/completions", _openai(CHOICES), opened))
    peak = baseline

    def sample() -> None:
        nonlocal peak
        peak = max(peak, _rss(gateway))

    jobs = _until_ended(db, NATIVE_STREAMS + CHOICES, old, during=sample)
    output = sum(len(d) for j in jobs for _, d in _log(db, j))
    print(
        f"jobs wrote {output / MiB:.0f} MiB of events to clients that read none; gateway RSS "
        f"{baseline / MiB:.0f} MiB, at most +{(peak - baseline) / MiB:.1f} MiB"
    )
    assert _statuses(db, jobs).count("succeeded") == len(jobs)  # nobody disconnected
    assert output > MIN_OUTPUT
    assert peak - baseline < MAX_GROWTH  # the old gateway: +126 MiB here, +512 after
    for c in opened:
        c.close()
    wait_for(lambda: not any(_connected(gateway, c) for c in clients), 10, what="streams gone")
    after = _rss(gateway) - baseline
    print(f"after the clients closed: +{after / MiB:.1f} MiB")
    assert after < MAX_GROWTH


@pytest.mark.contract
def test_a_slow_reader_gets_its_whole_stream_exactly_as_the_log_holds_it(
    cluster: Cluster, db: redis.Redis, opened: list[SilentClient]
) -> None:
    gateway = cluster.gateway(
        GENQ_STREAM_BUFFER_BYTES=str(SMALL_BUFFER_BYTES), GENQ_STREAM_STALL_TIMEOUT_S=str(LONG_S)
    )
    cluster.worker("--step-ms", "0")
    native = SilentClient(gateway, "/v1/jobs", _native(1, max_tokens=LONGEST), opened)
    chat = SilentClient(gateway, "/v1/chat/completions", _openai(CHOICES), opened)
    jobs = _until_ended(db, 1 + CHOICES, set())
    # More than the kernel holds for a client: the gateway's buffers overflowed and it read
    # the rest from the logs as the clients caught up.
    assert min(sum(len(d) for _, d in _log(db, j)) for j in jobs) > _kernel_send_buffer_max()
    headers, body = native.read_response()
    log = _log(db, headers["x-job-id"])
    assert _frames(body) == [(str(seq), json.loads(d)["type"], d) for seq, d in log]
    headers, body = chat.read_response()
    frames = [d for _, _, d in _frames(body)]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(d) for d in frames[:-1]]
    for index, job_id in enumerate(headers["x-job-ids"].split(",")):
        tokens = [json.loads(d) for _, d in _log(db, job_id)]
        tokens = [e for e in tokens if e["type"] == "token"]
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content") or "" for c in mine) == "".join(
            e["text"] for e in tokens
        )
        logprobs = [lp for c in mine if c.get("logprobs") for lp in c["logprobs"]["content"]]
        assert [lp["token"] for lp in logprobs] == [
            lp["token"] for e in tokens for lp in e["logprobs"]
        ]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]


@pytest.mark.contract
def test_a_client_that_reads_nothing_is_disconnected_after_the_stall_timeout(
    cluster: Cluster, db: redis.Redis, opened: list[SilentClient]
) -> None:
    gateway = cluster.gateway(
        GENQ_STREAM_BUFFER_BYTES=str(BUFFER_BYTES), GENQ_STREAM_STALL_TIMEOUT_S=str(STALL_S)
    )
    cluster.worker("--step-ms", str(STEADY_STEP_MS))
    native = SilentClient(gateway, "/v1/jobs", _native(1, max_tokens=LONGEST), opened)
    chat = SilentClient(gateway, "/v1/chat/completions", _openai(1, max_tokens=LONGEST), opened)
    wait_for(lambda: _statuses(db, _job_ids(db)) == ["running"] * 2, DISCONNECT_S, what="running")
    assert _connected(gateway, native) and _connected(gateway, chat)
    for client in (native, chat):
        wait_for(lambda c=client: not _connected(gateway, c), DISCONNECT_S, what="disconnected")
    ids = _job_ids(db)
    by_api = {json.loads(cast(str, db.hget(KEYS.job(j), "metadata"))).get("api"): j for j in ids}
    chat_job, native_job = by_api["openai.chatcmpl"], by_api[None]
    # The OpenAI client's job is cancelled as on any disconnect; the native stream did not ask.
    wait_for(lambda: _statuses(db, [chat_job]) == ["cancelled"], DISCONNECT_S, what="cancelled")
    assert _statuses(db, [native_job]) == ["running"]
    assert not native.read_all().endswith(END_OF_BODY)  # cut off, not ended
    assert "client stopped reading its stream" in gateway.output()
