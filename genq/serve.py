"""`genq serve`: gateway and worker(s) on one box, decided up front.

One plan, chosen before anything starts (`plan_serve`):
  single   one process: the gateway app and one in-process worker share an event loop and a
           Redis client. Used when one worker process per GPU is wanted on one GPU, or when no
           Redis can be shared between processes.
  multi    this process runs the gateway (uvicorn); a child runs the launcher with N worker
           processes per GPU. Needs a Redis every process can reach.

Redis, in this order: GENQ_REDIS_URL (or GENQ_REDIS_SENTINELS); a private `redis-server` on a
free port, stopped on exit, its data kept in a per-user folder (or nowhere, `--ephemeral`: see
genq/embedded_redis.py); in-process fakeredis (single only).

Every process it starts (the redis-server, the worker launcher, an engine process) dies with
it, however it dies (shared/lifeline.py).

The listening socket comes first: a busy port stops `genq serve` before Redis or any worker
starts, and the address is printed only once it is ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.http_protocol import HTTP_PROTOCOL
from gateway.server import listen, run_gateway, url_of
from genq import gpu_share, launcher
from genq.embedded_redis import private_redis
from shared import lifeline, logs, runtime
from shared.redisconn import connect
from shared.settings import Settings
from worker.process import install_signals, open_engine
from worker.service import Worker

log = logging.getLogger(__name__)
TRY_MAX_TOKENS = 16
"""max_tokens of the curl line printed as the first thing to try."""


@dataclass(frozen=True)
class ServePlan:
    gpus: list[str]
    procs_per_gpu: int

    @property
    def multi(self) -> bool:
        return self.procs_per_gpu > 1 or len(self.gpus) > 1


def plan_serve(settings: Settings, gpus: str | None, procs_per_gpu: str | None) -> ServePlan:
    """The GPUs and processes per GPU; SystemExit with one line where they cannot fit
    (genq/gpu_share.py)."""
    gpu_list = launcher.parse_gpus(gpus)
    procs = launcher.resolve_procs(settings, gpu_list, procs_per_gpu)
    gpu_share.check_fits(settings, gpu_list, procs)
    return ServePlan(gpu_list, procs)


def serve(
    settings: Settings,
    host: str,
    port: int,
    gpus: str | None,
    procs_per_gpu: str | None,
    data_dir: Path | None,
    data_dir_chosen: bool = True,
    plan: ServePlan | None = None,
) -> int:
    """`data_dir`: where the private redis-server keeps its data (None: nothing is kept);
    `data_dir_chosen`: given by the user (not the default), so one that cannot be made stops
    the start; `plan`: made already (`plan_serve`)."""
    sock = listen(host, port)
    url = url_of(sock)
    plan = plan or plan_serve(settings, gpus, procs_per_gpu)
    with sock, contextlib.ExitStack() as stack:
        if not settings.redis_configured and (
            redis_url := stack.enter_context(private_redis(data_dir, data_dir_chosen))
        ):
            settings = settings.model_copy(update={"redis_url": redis_url})
        if not settings.redis_configured and plan.multi:
            log.warning("no redis-server to share between worker processes: running one")
            plan = ServePlan(plan.gpus[:1], 1)
        if plan.multi:
            return _serve_multi(settings, sock, url, plan)
        return runtime.run(_serve_single(settings, _client(settings), sock, url))


def served_model(settings: Settings) -> str:
    """The name clients ask for: --model-name, else the model folder's name, else `sim`."""
    if settings.model_name:
        return settings.model_name
    return Path(settings.model_dir).name if settings.model_dir else "sim"


def _announce(url: str, what: str, model: str) -> None:
    """Where genq answers, and a first request to try."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": TRY_MAX_TOKENS})
    print(f"genq serving {what} on {url}  (docs: {url}/docs)", flush=True)
    print(
        f"try: curl -s {url}/v1/completions -H 'content-type: application/json' "
        f"-d {shlex.quote(body)}",
        flush=True,
    )


def _client(settings: Settings) -> aioredis.Redis:
    if settings.redis_configured:
        return connect(settings)
    import fakeredis  # only here: no other genq process needs it

    log.warning("no redis-server found: using in-process fakeredis (one process only)")
    return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)


async def _serve_single(
    settings: Settings, client: aioredis.Redis, sock: socket.socket, url: str
) -> int:
    worker = Worker(settings, await open_engine(settings), redis=client)
    app = create_app(settings, redis=client, raw_pubsub=settings.redis_configured)
    app.state.metrics.extra.append(worker.st.metrics.render)  # one /metrics for both
    config = uvicorn.Config(
        app,
        log_config=logs.log_config(settings),
        access_log=False,  # genq's own (gateway/access_log.py, GENQ_ACCESS_LOG) replaces it
        http=HTTP_PROTOCOL,  # streams can drop a client that stopped reading
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )
    server = _DrainingServer(config, app, worker)
    worker_task = asyncio.create_task(worker.run())

    def stop() -> None:
        server.should_exit = True
        worker.stop()

    install_signals(stop)  # uvicorn restores (and re-raises into) these after its own
    server_task = asyncio.create_task(server.serve(sockets=[sock]))
    model = worker.st.model
    _announce(url, f"model '{model}' ({worker.st.engine.card.engine} engine)", model)
    await asyncio.wait({server_task, worker_task}, return_when=asyncio.FIRST_COMPLETED)
    stop()
    await asyncio.gather(server_task, worker_task, return_exceptions=True)
    await client.aclose()
    return 0 if worker.st.healthy else 1


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, told of `genq serve`'s worker. The first SIGINT or SIGTERM drains:
    uvicorn stops accepting and lets open streams end with their `done` (the worker and Redis
    run on until then), and a request that still reaches the app gets a 503 at once. A second
    Ctrl-C stops now: uvicorn closes the open streams, and the worker hands its jobs back to
    the queue without waiting for them."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, worker: Worker) -> None:
        super().__init__(config)
        self.app = app
        self.worker = worker

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        draining = self.should_exit
        super().handle_exit(sig, frame)
        state = getattr(self.app.state, "genq", None)
        if state is not None:
            state.draining = True
        if draining and sig == signal.SIGINT:
            self.worker.stop(now=True)


def _serve_multi(settings: Settings, sock: socket.socket, url: str, plan: ServePlan) -> int:
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
        preexec_fn=lifeline.preexec(),  # drains and exits when this process dies
        # a group of its own (its worker processes join it): a terminal's Ctrl-C reaches this
        # process alone, which drains the workers beside the gateway, or stops them at once
        process_group=0,
    )
    model = served_model(settings)
    where = f"{plan.procs_per_gpu} worker process(es) per GPU on GPU(s) {','.join(plan.gpus)}"
    _announce(url, f"model '{model}' ({where})", model)

    signals = 0

    def drain(*_: object) -> None:
        # uvicorn re-raises each signal that stopped it once it is done; this handler catches
        # them (instead of the default, which would kill us before the workers drained) and
        # starts the workers' drain beside the gateway's. A second signal (Ctrl-C twice)
        # stops the launcher and its workers at once: their jobs stay in Redis, reclaimed
        # after the lease by the next worker.
        nonlocal signals
        signals += 1
        if workers.poll() is None:
            if signals == 1:
                workers.send_signal(signal.SIGTERM)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(workers.pid, signal.SIGKILL)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    try:
        run_gateway(settings, sock, 1)
    finally:
        if not signals:  # the gateway stopped by itself
            drain()
        try:
            code = workers.wait(settings.shutdown_grace_s + 2 * launcher.KILL_MARGIN_S)
        except subprocess.TimeoutExpired:
            workers.kill()
            code = workers.wait()
    return code
