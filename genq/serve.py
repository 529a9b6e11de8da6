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
starts. The address and a first request to try are printed once a worker serves the model,
so that request, sent at once, succeeds: `single` serves the port only from then on (what
connects earlier waits in its backlog); `multi` serves it at once (health, dashboard) and its
gateway answers a request for the model a 503 `model_starting` until a worker registered it
(GENQ_QUEUE_MODELS names it), since a prompt cannot be tokenized before the worker has
published the model's tokenizer, and a GPU model may take minutes to load.

Ctrl-C (or SIGTERM) stops the gateway and the workers together (gateway/stopping.py,
worker/drain.py), saying on the terminal what it waits for: running jobs whose streams are
gone go back to the queue at once; open streams get the grace (GENQ_SHUTDOWN_GRACE_S: 5 s
here unless set) to end with their jobs, then each ends with a `server_stopping` error; the
same signal again ends them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
import uvicorn
from redis.exceptions import RedisError

from gateway.app import create_app
from gateway.http_protocol import HTTP_PROTOCOL
from gateway.registry import ModelRegistry
from gateway.server import listen, run_gateway, url_of
from gateway.stopping import Stopping, uvicorn_timeout_s
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
SERVED_POLL_S = 0.05
"""How often the start looks for a live worker of the model before it prints the address."""
SERVE_SHUTDOWN_GRACE_S = 5.0
"""`genq serve`'s GENQ_SHUTDOWN_GRACE_S unless it is set: someone at a terminal waits out a
Ctrl-C, where a fleet's rolling restart can give streams longer."""


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
    if "shutdown_grace_s" not in settings.model_fields_set:  # a fleet's default is too long
        settings = settings.model_copy(update={"shutdown_grace_s": SERVE_SHUTDOWN_GRACE_S})
    plan = plan or plan_serve(settings, gpus, procs_per_gpu)
    expected = sorted({*settings.queue_models, served_model(settings)})
    settings = settings.model_copy(update={"queue_models": expected})
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


async def _until_served(
    client: aioredis.Redis, settings: Settings, model: str, alive: Callable[[], bool]
) -> bool:
    """Wait until a live worker serves `model` (its card written, its heartbeat fresh: what
    the gateway asks before it takes a request for it); False once `alive()` is not."""
    keys = settings.keys()
    registry = ModelRegistry(client, keys, settings.card_cache_s)
    while alive():
        with contextlib.suppress(RedisError, OSError):
            beats = await registry.live_workers()
            if any(b.model == model and not b.draining for b in beats):
                if await client.exists(keys.model_card(model)):
                    return True
        await asyncio.sleep(SERVED_POLL_S)
    return False


def _announce_when_served(
    settings: Settings, url: str, what: str, model: str, alive: Callable[[], bool]
) -> None:
    """`_announce` once a worker serves `model` (a thread of its own: the gateway's uvicorn
    holds the main one)."""

    async def wait() -> bool:
        client = connect(settings)
        try:
            return await _until_served(client, settings, model, alive)
        finally:
            await client.aclose()

    if runtime.run(wait()):
        _announce(url, what, model)


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
    app = create_app(settings, redis=client, raw_pubsub=settings.redis_configured, signals=True)
    app.state.metrics.extra.append(worker.st.metrics.render)  # one /metrics for both
    config = uvicorn.Config(
        app,
        log_config=logs.log_config(settings),
        access_log=False,  # genq's own (gateway/access_log.py, GENQ_ACCESS_LOG) replaces it
        http=HTTP_PROTOCOL,  # streams can drop a client that stopped reading
        timeout_graceful_shutdown=uvicorn_timeout_s(settings.shutdown_grace_s),
    )
    server = uvicorn.Server(config)
    # The gateway's stop (gateway/stopping.py) is the worker's: its first signal drains the
    # worker beside the streams, the same signal again hands the worker's jobs back at once.
    stopping: Stopping = app.state.stopping
    _tell(stopping)
    worker.tell = stopping.say
    stopping.on_begin(worker.stop)
    stopping.on_end(functools.partial(worker.stop, now=True))
    worker_task = asyncio.create_task(worker.run())

    def stop() -> None:
        server.should_exit = True
        worker.stop()

    # uvicorn restores (and re-raises into) these after its own: the loop takes them then
    install_signals(stop)
    model = worker.st.model
    served = await _until_served(client, settings, model, lambda: not worker_task.done())
    server_task = asyncio.create_task(server.serve(sockets=[sock]))
    if served:
        _announce(url, f"model '{model}' ({worker.st.engine.card.engine} engine)", model)
    await asyncio.wait({server_task, worker_task}, return_when=asyncio.FIRST_COMPLETED)
    if worker_task.done():  # it gave up by itself: nothing more comes for the open streams
        stopping.end()
    stop()
    await asyncio.gather(server_task, worker_task, return_exceptions=True)
    await client.aclose()
    return 0 if worker.st.healthy else 1


def _tell(stopping: Stopping) -> None:
    """The stop in words on the terminal, beside the log."""
    stopping.say = functools.partial(print, "genq:", flush=True)


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
    print(f"genq starting model '{model}' ({where}) on {url}", flush=True)
    threading.Thread(
        target=_announce_when_served,
        args=(settings, url, f"model '{model}' ({where})", model, lambda: workers.poll() is None),
        name="announce",
        daemon=True,
    ).start()
    told = 0

    def tell_workers() -> None:
        """SIGTERM to the launcher: the first drains its workers beside the gateway's
        streams; the second (the same signal again here) hands their jobs back at once."""
        nonlocal told
        told += 1
        if workers.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                workers.send_signal(signal.SIGTERM)

    def attach(stopping: Stopping) -> None:
        _tell(stopping)
        stopping.on_begin(tell_workers)
        stopping.on_end(tell_workers)

    try:  # a signal before the gateway serves stops the start (SystemExit): workers drain
        run_gateway(settings, sock, 1, attach)
    finally:
        if not told:  # the gateway stopped by itself (or before its app could hear a signal)
            tell_workers()
        try:
            code = workers.wait(settings.shutdown_grace_s + 2 * launcher.KILL_MARGIN_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(workers.pid, signal.SIGKILL)
            code = workers.wait()
    return code
