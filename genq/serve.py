"""`genq serve`: gateway and worker(s) on one box, decided up front.

One plan, chosen before anything starts (`plan_serve`):
  single   one process: the gateway app and one in-process worker share an event loop and a
           Redis client. Used when one worker process per GPU is wanted on one GPU, or when no
           Redis can be shared between processes.
  multi    this process runs the gateway (uvicorn); a child runs the launcher with N worker
           processes per GPU. Needs a Redis every process can reach.

Redis, in this order: GENQ_REDIS_URL; a private `redis-server` started in a temporary directory
on a free port and stopped on exit; in-process fakeredis (single only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import redis.asyncio as aioredis
import uvicorn

from gateway.app import create_app
from gateway.server import run_gateway
from genq import launcher
from genq.embedded_redis import private_redis
from shared import logs, runtime
from shared.redisconn import connect
from shared.settings import Settings
from worker.process import build_engine, install_signals
from worker.service import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServePlan:
    gpus: list[str]
    procs_per_gpu: int

    @property
    def multi(self) -> bool:
        return self.procs_per_gpu > 1 or len(self.gpus) > 1


def plan_serve(settings: Settings, gpus: str | None, procs_per_gpu: str | None) -> ServePlan:
    gpu_list = launcher.parse_gpus(gpus)
    return ServePlan(gpu_list, launcher.resolve_procs(settings, gpu_list, procs_per_gpu))


def serve(
    settings: Settings, host: str, port: int, gpus: str | None, procs_per_gpu: str | None
) -> int:
    plan = plan_serve(settings, gpus, procs_per_gpu)
    with contextlib.ExitStack() as stack:
        url = settings.redis_url or stack.enter_context(private_redis())
        if url is not None:
            settings = settings.model_copy(update={"redis_url": url})
        elif plan.multi:
            log.warning("no redis-server to share between worker processes: running one")
            plan = ServePlan(plan.gpus[:1], 1)
        if plan.multi:
            return _serve_multi(settings, host, port, plan)
        return runtime.run(_serve_single(settings, _client(settings), host, port))


def _client(settings: Settings) -> aioredis.Redis:
    if settings.redis_url:
        return connect(settings)
    import fakeredis  # only here: no other genq process needs it

    log.warning("no redis-server found: using in-process fakeredis (one process only)")
    return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)


async def _serve_single(settings: Settings, client: aioredis.Redis, host: str, port: int) -> int:
    worker = Worker(settings, build_engine(settings), redis=client)
    app = create_app(settings, redis=client, raw_pubsub=settings.redis_url is not None)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=logs.log_config(settings),
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
        f"genq serving model '{worker.st.model}' ({worker.st.engine.card.engine} engine) "
        f"on http://{host}:{port}  (docs: /docs)",
        flush=True,
    )
    await asyncio.wait({server_task, worker_task}, return_when=asyncio.FIRST_COMPLETED)
    stop()
    await asyncio.gather(server_task, worker_task, return_exceptions=True)
    await client.aclose()
    return 0 if worker.st.healthy else 1


def _serve_multi(settings: Settings, host: str, port: int, plan: ServePlan) -> int:
    """The gateway here, the launcher (N worker processes per GPU) in a child."""
    os.environ.update(launcher.settings_env(settings))  # the gateway's uvicorn reads GENQ_*
    workers = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "genq",
            "worker",
            "--gpus",
            ",".join(plan.gpus),
            "--procs-per-gpu",
            str(plan.procs_per_gpu),
        ],
        env=os.environ.copy(),
    )
    print(
        f"genq serving on http://{host}:{port} with {plan.procs_per_gpu} worker process(es) "
        f"per GPU on GPU(s) {','.join(plan.gpus)}",
        flush=True,
    )

    def drain(*_: object) -> None:
        # uvicorn re-raises the signal that stopped it once it is done; this handler catches
        # that (instead of the default, which would kill us before the workers drained) and
        # starts the workers' drain beside the gateway's.
        if workers.poll() is None:
            workers.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    try:
        run_gateway(settings, host, port, 1)
    finally:
        drain()
        try:
            code = workers.wait(settings.shutdown_grace_s + 2 * launcher.KILL_MARGIN_S)
        except subprocess.TimeoutExpired:
            workers.kill()
            code = workers.wait()
    return code
