"""Building the engine named in settings (sim, exllamav2, exllamav3), in whichever process runs
it: the engine process (worker/engine_process.py) or, in-process, the worker itself."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from shared.model_format import folder_format
from shared.settings import EngineSettings
from worker.engine import Engine
from worker.sim import SimEngine

EXL2_MODULES = ("torch", "exllamav2")
ENGINE_MODULES = {"exllamav2": EXL2_MODULES, "exllamav3": ("torch", "exllamav3")}
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


def build_engine(settings: EngineSettings) -> Engine:
    check_engine(settings)
    if settings.engine == "sim":
        return SimEngine(
            model_name=settings.model_name or "sim",
            max_batch=settings.max_batch,
            step_ms=settings.sim_step_ms,
            prefill_ms_per_1k=settings.sim_prefill_ms_per_1k,
            max_seq_len=settings.sim_max_seq_len,
            cache_tokens=settings.sim_cache_tokens,
            prefill_chunk_tokens=settings.sim_prefill_chunk_tokens,
            poison_marker=settings.sim_poison_marker,
        )
    if settings.engine == "exllamav3":
        from worker.exl3.engine import ExLlamaV3Engine  # lazy: only this engine needs torch

        return ExLlamaV3Engine.from_settings(settings)
    from worker.exl2.engine import ExLlamaV2Engine  # lazy: only this engine needs torch

    return ExLlamaV2Engine.from_settings(settings)
