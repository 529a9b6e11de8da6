"""`genq worker`: start the engine named in settings (in its engine process, by default) and
serve until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from shared import runtime
from shared.settings import WorkerSettings
from worker import cpus
from worker.engine_client import EngineProcess, EngineStartError
from worker.engines import EXL2_MODULES, build_engine, check_engine, require_gpu_extra
from worker.health import Health
from worker.http import HttpServer
from worker.link import EngineLink
from worker.metrics import MetricsRoute
from worker.runner import EngineRunner
from worker.service import RedisStartTimeout, Worker

log = logging.getLogger(__name__)
_SIM_GIL_SWITCH_S = 0.0005
_DEFAULT_GIL_SWITCH_S = 0.005  # CPython's own default
__all__ = ["EXL2_MODULES", "build_engine", "check_engine", "require_gpu_extra", "run"]


def install_signals(stop: Callable[[], None], now: Callable[[], None] | None = None) -> None:
    """SIGTERM or SIGINT calls `stop`; the same signal once more calls `now` (a second Ctrl-C,
    a second SIGTERM). One of each (a terminal's Ctrl-C reaching a process that its supervisor
    then stops) is one stop."""
    loop = asyncio.get_running_loop()
    seen: set[int] = set()

    def handle(sig: int) -> None:
        if sig in seen and now is not None:
            now()
            return
        seen.add(sig)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle, sig)


def ignore_signals() -> None:
    """The stop is done: a signal that comes as the process leaves (its supervisor's second
    SIGTERM, sent as this one was exiting) must not turn a clean exit into a death by signal,
    as the default handlers the loop restores would."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


async def serve_worker(settings: WorkerSettings, early: list[int] | None = None) -> int:
    """The worker until its stop. `early`: stop signals that came before the loop could take
    them; one then (or while the engine starts) ends the start, exit 0."""
    stopped = asyncio.Event()
    install_signals(stopped.set)  # until the worker takes them over
    if early:
        stopped.set()
    # In-process, the engine thread computes while this thread does Redis I/O; how often the
    # GIL changes hands decides who waits: a 0.5 ms interval made the sim worker 1.7 x faster,
    # and exllamav2's about 6 % slower than CPython's 5 ms (measured on the dev box and an H200).
    interval = settings.gil_switch_interval_s
    if interval is None:
        interval = _SIM_GIL_SWITCH_S if settings.engine == "sim" else _DEFAULT_GIL_SWITCH_S
    sys.setswitchinterval(interval)
    pinned = cpus.apply(settings.cpus)  # before torch loads (here or in the engine process)
    if pinned is not None:
        log.info("pinned to CPUs", extra={"cpus": settings.cpus, "count": pinned})
    health = Health()
    metrics = MetricsRoute()
    server = await _start_http(settings, health, metrics)
    try:
        try:
            engine = await _unless_stopped(open_engine(settings), stopped)  # probes answered
        except EngineStartError as exc:
            log.error("the engine did not start", extra={"error": str(exc)})
            return 1
        if engine is None:
            log.info("stopped before the engine started")
            ignore_signals()
            return 0
        return await _serve(settings, engine, health, metrics, stopped)
    finally:
        if server is not None:
            await server.close()


async def open_engine(settings: WorkerSettings) -> EngineLink:
    """The engine in its own process (once its model is loaded), or on a thread of this one
    with GENQ_ENGINE_PROCESS=false."""
    if settings.engine_process:
        return await EngineProcess.spawn(settings)
    # In a thread (which inherits the CPU set), so that probes are answered meanwhile.
    engine = await asyncio.to_thread(build_engine, settings)
    return EngineRunner(engine, detokenize=settings.detokenize == "worker")


async def _unless_stopped(
    starting: Awaitable[EngineLink], stopped: asyncio.Event
) -> EngineLink | None:
    """The engine, or None if `stopped` comes first (its start is cancelled: an engine
    process is killed)."""
    start = asyncio.ensure_future(starting)
    stop = asyncio.ensure_future(stopped.wait())
    await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if start.done():
        return start.result()
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await start
    return None


async def _start_http(
    settings: WorkerSettings, health: Health, metrics: MetricsRoute
) -> HttpServer | None:
    if settings.metrics_port is None:
        return None
    server = HttpServer(settings.metrics_host, settings.metrics_port)
    health.install(server)
    metrics.install(server)
    await server.start()
    return server


async def _serve(
    settings: WorkerSettings,
    engine: EngineLink,
    health: Health,
    metrics: MetricsRoute,
    stopped: asyncio.Event,
) -> int:
    worker = Worker(settings, engine)
    health.attach(worker.st)
    metrics.attach(worker.st.metrics)
    runtime.tune_gc()
    install_signals(worker.stop, lambda: worker.stop(now=True))
    if stopped.is_set():  # as the engine came up
        worker.stop()
    try:
        await worker.run()  # closes the engine as it leaves
    except RedisStartTimeout as exc:
        log.error(
            "giving up: Redis never answered",
            extra={"error": str(exc), "redis": exc.where, "limit_s": exc.limit_s},
        )
        return 1
    finally:
        ignore_signals()
        await worker.st.redis.aclose()
    return 0 if worker.st.healthy else 1


def run(settings: WorkerSettings, early: list[int] | None = None) -> int:
    return runtime.run(serve_worker(settings, early))
