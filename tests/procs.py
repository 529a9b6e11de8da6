"""Real processes for end-to-end and chaos tests: redis-server, `genq gateway`, `genq worker`."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.prefixes import test_prefix


def engine_processes(worker_pid: int) -> list[psutil.Process]:
    """A worker's live engine processes (`python -m worker.engine_process`; a killed one not
    reaped yet is left out)."""
    out = []
    for c in psutil.Process(worker_pid).children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "worker.engine_process" in c.cmdline():
                out.append(c)
        except psutil.Error:
            continue
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.02, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what or predicate}")


def redis_conf_in(config: Path, data_dir: Path) -> Path:
    """A copy of `config` in `data_dir` whose `dir` is `data_dir`. Redis enters a config
    file's `dir` as it reads the line, before any --dir given after the file, so a `dir`
    that does not exist here (deploy/redis.conf's) stops it unless replaced."""
    lines = [line for line in config.read_text().splitlines() if line.split()[:1] != ["dir"]]
    lines.append(f"dir {data_dir}")
    copy = data_dir / config.name
    copy.write_text("\n".join(lines) + "\n")
    return copy


@dataclass
class RedisServer:
    """A private redis-server (AOF on) that tests may kill and restart on the same port."""

    dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    config: Path | None = None
    """A redis.conf to start from (e.g. deploy/redis.conf); else AOF with fsync always."""
    args: tuple[str, ...] = ()
    """More redis-server options (TLS, a unix socket, a password), appended last."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        durability = ["--appendonly", "yes", "--appendfsync", "always"]
        durability += ["--maxmemory-policy", "noeviction"]
        if self.config is not None:
            durability = [str(redis_conf_in(self.config, self.dir))]
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                *durability,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(
            lambda: socket.create_connection(("127.0.0.1", self.port), 0.2).close() is None,
            what="redis-server",
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def redis_server(config: Path | None = None) -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="genq-test-redis-") as tmp:
        server = RedisServer(Path(tmp), config=config)
        server.start()
        try:
            yield server
        finally:
            server.kill()


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Cluster:
    """genq processes sharing one Redis and key prefix; all stopped on exit."""

    def __init__(self, redis_url: str, tmp: Path, prefix: str, **env: str) -> None:
        self.redis_url = redis_url
        self.tmp = tmp
        self.env = {
            **os.environ,
            "GENQ_REDIS_URL": redis_url,
            "GENQ_KEY_PREFIX": prefix,
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.procs: list[Proc] = []

    def _spawn(self, name: str, args: list[str], port: int | None = None, **env: str) -> Proc:
        log = self.tmp / f"{name}-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "genq", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, **env},
            )
        p = Proc(name, proc, log, port)
        self.procs.append(p)
        return p

    def gateway(self, processes: int = 1, ready_s: float = 15.0, **env: str) -> Proc:
        port = free_port()
        args = ["gateway", "--port", str(port), "--workers", str(processes)]
        p = self._spawn("gateway", args, port, **env)
        wait_for(
            lambda: httpx.get(f"{p.url}/readyz", timeout=1).status_code == 200,
            timeout=ready_s,
            what=f"gateway on {port}: {p.output()[-500:] if p.log.exists() else ''}",
        )
        return p

    def worker(
        self, *args: str, wait_model: str | None = "sim", ready_s: float = 15.0, **env: str
    ) -> Proc:
        p = self._spawn("worker", ["worker", *args], **env)
        if wait_model is not None and self.procs:
            gateways = [g for g in self.procs if g.name == "gateway"]
            if gateways:
                url = gateways[0].url
                keyed = env.get("GENQ_API_KEYS") or self.env.get("GENQ_API_KEYS")
                auth = {"Authorization": f"Bearer {keyed.split(',')[0]}"} if keyed else {}
                wait_for(
                    lambda: any(
                        m["id"] == wait_model
                        for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]
                    ),
                    timeout=ready_s,
                    what=f"worker serving {wait_model}: {p.output()[-500:]}",
                )
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            p.kill()


class StallProxy:
    """A TCP proxy to a Redis that can stall: while stalled it forwards nothing either way
    (data waits, as on a network that drops every packet but the connection stays up), and
    on `resume` it delivers everything that waited. Its own thread and event loop, so the
    tests' blocking waits do not stall it."""

    def __init__(self, target_port: int) -> None:
        import asyncio
        import threading

        self.target_port = target_port
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._flowing = threading.Event()
        self._flowing.set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        import asyncio

        self._thread.start()
        listen = asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self._server = asyncio.run_coroutine_threadsafe(listen, self._loop).result(5)

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        import asyncio

        self._flowing.set()
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _shutdown(self) -> None:
        import asyncio

        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # each transport closes on a later turn of this loop: let it, before the loop stops (a
        # transport left open is reported at its garbage collection, in whatever test runs then)
        closing = asyncio.gather(*(w.wait_closed() for w in self._writers), return_exceptions=True)
        await asyncio.wait_for(closing, 5)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader, writer) -> None:  # type: ignore[no-untyped-def]
        import asyncio

        self._writers.append(writer)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.append(up_w)
        for task in (self._pipe(reader, up_w), self._pipe(up_r, writer)):
            t = asyncio.ensure_future(task)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader, writer) -> None:  # type: ignore[no-untyped-def]
        import asyncio

        try:
            while data := await reader.read(65536):
                while not self._flowing.is_set():
                    await asyncio.sleep(0.01)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


QUICK_ENV = {
    "GENQ_HEARTBEAT_S": "0.2",
    "GENQ_LEASE_S": "2",
    "GENQ_CLAIM_BLOCK_MS": "200",
    "GENQ_SHUTDOWN_GRACE_S": "3",
}
"""Leases, heartbeats and drains short enough for tests that wait on them."""


@contextlib.contextmanager
def quick_cluster(redis_url: str, tmp: Path, tag: str, **env: str) -> Iterator[Cluster]:
    """A Cluster under a fresh `tag:…:` prefix with QUICK_ENV (overridden by `env`); every
    process it started is stopped with SIGTERM first (a supervisor, uvicorn's or the
    launcher's, killed outright leaves its children running), then the rest is cleaned."""
    c = Cluster(redis_url, tmp, test_prefix(tag), **{**QUICK_ENV, **env})
    try:
        yield c
    finally:
        for p in reversed(c.procs):
            p.stop()
        c.close()
