"""`genq worker`: build the engine named in settings and serve until SIGTERM."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from shared import runtime
from shared.model_format import folder_format
from shared.settings import EngineSettings, WorkerSettings
from worker import cpus
from worker.engine import Engine
from worker.health import Health
from worker.http import HttpServer
from worker.service import Worker
from worker.sim import SimEngine

log = logging.getLogger(__name__)
_SIM_GIL_SWITCH_S = 0.0005
_DEFAULT_GIL_SWITCH_S = 0.005  # CPython's own default
ENGINE_MODULES = {"exllamav2": ("torch", "exllamav2"), "exllamav3": ("torch", "exllamav3")}
"""What each GPU engine imports: the gpu extra (a CPU install has none of them)."""
UNREADABLE = {"exllamav2": "exl3", "exllamav3": "exl2"}
"""The quantized format each engine cannot read."""


def require_gpu_extra(what: str, modules: Sequence[str]) -> None:
    """SystemExit with one line when a module of the gpu extra is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"genq: error: {what} needs the gpu extra: pip install 'genq[gpu]' "
            f"(missing: {', '.join(missing)})"
        )


def check_engine(settings: EngineSettings) -> None:
    """Stop with one line, before anything starts, on what would keep the engine from
    loading: no model folder, or no gpu extra."""
    engine = settings.engine
    if engine == "sim":
        return
    if not settings.model_dir:
        raise SystemExit(f"genq: error: --engine {engine} needs --model DIR")
    folder = Path(settings.model_dir).expanduser()
    if not folder.is_dir():
        raise SystemExit(f"genq: error: no model folder at {settings.model_dir} (--model)")
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"genq: error: {settings.model_dir} has no config.json: not a model folder (--model)"
        )
    fmt = folder_format(folder)
    if fmt == UNREADABLE[engine]:
        raise SystemExit(
            f"genq: error: {settings.model_dir} is an {fmt.upper()} model, which {engine} "
            "cannot read (--engine; left out, genq picks the engine from the folder)"
        )
    require_gpu_extra(f"the {engine} engine", ENGINE_MODULES[engine])


def build_engine(settings: WorkerSettings) -> Engine:
    check_engine(settings)
    if settings.engine == "sim":
        return SimEngine(
            model_name=settings.model_name or "sim",
            max_batch=settings.max_batch,
            step_ms=settings.sim_step_ms,
            prefill_ms_per_1k=settings.sim_prefill_ms_per_1k,
            max_seq_len=settings.sim_max_seq_len,
            poison_marker=settings.sim_poison_marker,
        )
    if settings.engine == "exllamav3":
        from worker.exl3.engine import ExLlamaV3Engine  # lazy: only this engine needs torch

        return ExLlamaV3Engine.from_settings(settings)
    from worker.exl2.engine import ExLlamaV2Engine  # lazy: only this engine needs torch

    return ExLlamaV2Engine.from_settings(settings)


def install_signals(stop: object) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)  # type: ignore[arg-type]


async def serve_worker(settings: WorkerSettings) -> int:
    # The engine thread computes while this thread does Redis I/O; how often the GIL changes
    # hands decides who waits (docs/benchmarks.md has both measurements).
    interval = settings.gil_switch_interval_s
    if interval is None:
        interval = _SIM_GIL_SWITCH_S if settings.engine == "sim" else _DEFAULT_GIL_SWITCH_S
    sys.setswitchinterval(interval)
    pinned = cpus.apply(settings.cpus)  # before torch loads: its pools size to the set
    if pinned is not None:
        log.info("pinned to CPUs", extra={"cpus": settings.cpus, "count": pinned})
    health = Health()
    server = await _start_http(settings, health)
    try:
        # In a thread (which inherits the CPU set): probes are answered while weights load.
        engine = await asyncio.to_thread(build_engine, settings)
        return await _serve(settings, engine, health)
    finally:
        if server is not None:
            await server.close()


async def _start_http(settings: WorkerSettings, health: Health) -> HttpServer | None:
    if settings.metrics_port is None:
        return None
    server = HttpServer(settings.metrics_host, settings.metrics_port)
    health.install(server)
    await server.start()
    return server


async def _serve(settings: WorkerSettings, engine: Engine, health: Health) -> int:
    worker = Worker(settings, engine)
    health.attach(worker.st)
    runtime.tune_gc()
    install_signals(worker.stop)
    try:
        await worker.run()
    finally:
        engine.close()
        await worker.st.redis.aclose()
    return 0 if worker.st.healthy else 1


def run(settings: WorkerSettings) -> int:
    return runtime.run(serve_worker(settings))
