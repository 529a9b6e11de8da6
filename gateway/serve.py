"""`genq gateway` (N uvicorn processes) and `genq serve` (gateway + worker in one process).

`genq serve` finds Redis in this order: GENQ_REDIS_URL; a private `redis-server` it starts in
a temporary directory on a free port and stops on exit; in-process fakeredis (one process only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import fakeredis
import redis.asyncio as aioredis
import uvicorn

from gateway.app import create_app
from shared import runtime
from shared.redisconn import connect
from shared.settings import Settings
from worker.main import build_engine, install_signals
from worker.service import Worker

log = logging.getLogger("genq.serve")
_REDIS_START_TIMEOUT_S = 10.0


def run_gateway(settings: Settings, host: str, port: int, processes: int) -> None:
    """N uvicorn worker processes; each builds its own Settings from GENQ_* (set by the CLI)."""
    # uvicorn drains on SIGTERM (stops accepting, lets open streams finish within the grace),
    # then re-raises the signal into the handler it found installed. With the default one the
    # drained gateway would die by SIGTERM; with this one it exits 0.
    signal.signal(signal.SIGTERM, _drained)
    uvicorn.run(
        "gateway.app:create_app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=processes,
        log_level="warning",
        access_log=False,  # one line per request and per stream costs more than it tells
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        backlog=4096,
    )


def _drained(signum: int, frame: object) -> None:
    log.info("gateway drained", extra={"signal": signum})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def private_redis() -> Iterator[str | None]:
    """A redis-server of our own (URL), or None when the binary is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="genq-redis-") as tmp:
        port = free_port()
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                tmp,
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                "noeviction",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for_port(port, proc)
            log.info("started private redis-server", extra={"port": port, "dir": tmp})
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            if proc.poll() is None:
                proc.kill()


def _wait_for_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _REDIS_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start in time")


def run_serve(settings: Settings, host: str, port: int) -> int:
    with contextlib.ExitStack() as stack:
        if settings.redis_url:
            client = connect(settings)
        else:
            url = stack.enter_context(private_redis())
            if url is not None:
                settings = settings.model_copy(update={"redis_url": url})
                client = connect(settings)
            else:
                log.warning("no redis-server found: using in-process fakeredis (one process only)")
                client = fakeredis.FakeAsyncRedis(
                    server=fakeredis.FakeServer(), decode_responses=True
                )
        return runtime.run(_serve(settings, client, host, port))


async def _serve(settings: Settings, client: aioredis.Redis, host: str, port: int) -> int:
    worker = Worker(settings, build_engine(settings), redis=client)
    app = create_app(settings, redis=client, raw_pubsub=settings.redis_url is not None)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,  # one line per request and per stream costs more than it tells
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )
    server = uvicorn.Server(config)
    worker_task = asyncio.create_task(worker.run())

    def stop() -> None:
        server.should_exit = True
        worker.stop()

    install_signals(stop)  # uvicorn restores (and re-raises into) these after its own
    server_task = asyncio.create_task(server.serve())
    print(
        f"genq serving model '{worker.model}' ({worker.engine.card.engine} engine) "
        f"on http://{host}:{port}  (docs: /docs)",
        flush=True,
    )
    await asyncio.wait({server_task, worker_task}, return_when=asyncio.FIRST_COMPLETED)
    stop()
    await asyncio.gather(server_task, worker_task, return_exceptions=True)
    await client.aclose()
    return 0 if worker.healthy else 1


def env_from_settings(settings: Settings) -> None:
    """Export settings given on the command line to child processes (uvicorn workers)."""
    for name, value in settings.model_dump(exclude_unset=True).items():
        if value is not None:
            os.environ[f"GENQ_{name.upper()}"] = str(value)
