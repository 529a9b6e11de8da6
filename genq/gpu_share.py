"""How the worker processes on one GPU share its memory, decided before any of them starts.

Each worker process loads its own copy of the weights and allocates its own cache. Left to
size its cache from the memory free when it loads, every process of a set started together
sees the whole GPU, and all but the first fail to allocate theirs. So the launcher decides
each process's cache first, from the GPU's memory as it stands before any starts (free, as
NVML or nvidia-smi says; `GENQ_GPU_MEMORY_GIB` replaces that figure):

    share = (memory × GPU_MEMORY_USABLE − N × (weights + PROC_OVERHEAD_BYTES)) / N

(the weights' size is their safetensors files' in the model folder). A process's cache is
its share, in whole pages, or what it would take by itself — `--cache-tokens` for the GPU
divided by N, else room for its batch — whichever is less, passed to it as
GENQ_CACHE_TOKENS. Where a share cannot hold one sequence of the model's length, N processes
do not fit: `genq serve` and `genq worker` stop before anything starts, with one line naming
the memory they need and the memory there (`check_fits`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from shared.settings import EngineSettings, WorkerSettings
from worker.dyngen.backend import PAGE_TOKENS, cache_tokens
from worker.exl2 import loader
from worker.gpus import free_memory_bytes

log = logging.getLogger(__name__)

GIB = 1024**3
PROC_OVERHEAD_BYTES = 3 * GIB
"""Per process beside weights and cache: CUDA context, activations, scratch buffers."""
GPU_MEMORY_USABLE = 0.9
"""The share of a GPU's memory genq plans to fill (the rest: fragmentation, other users)."""
CACHE_BYTES_PER_ELEMENT = {"FP16": 2.0, "Q8": 1.125, "Q6": 0.875, "Q4": 0.625}
"""K/V bytes per element by cache mode, quantisation scales included (approximate)."""
GPU_ENGINES = ("exllamav2", "exllamav3")


@dataclass(frozen=True)
class ModelSize:
    weights_bytes: int
    """One copy of the weights: the folder's safetensors files."""
    kv_per_token: int
    """K/V elements one cached token takes (every layer)."""


@dataclass(frozen=True)
class Share:
    """The plan for `procs` processes on each GPU of `memory_bytes`."""

    procs: int
    memory_bytes: int
    model: ModelSize
    kv_bytes_per_token: float
    seq_tokens: int
    """One sequence of the model's length: the least cache a process can run with."""

    @property
    def share_bytes(self) -> float:
        """Cache bytes per process."""
        usable = self.memory_bytes * GPU_MEMORY_USABLE
        return (usable - self.procs * (self.model.weights_bytes + PROC_OVERHEAD_BYTES)) / self.procs

    @property
    def cache_tokens(self) -> int:
        """Cache tokens per process that its share holds, in whole pages (0: none)."""
        tokens = int(max(0.0, self.share_bytes) // self.kv_bytes_per_token)
        return tokens // PAGE_TOKENS * PAGE_TOKENS

    @property
    def fits(self) -> bool:
        return self.cache_tokens >= self.seq_tokens

    def needed_bytes(self) -> float:
        """The memory `procs` processes need at the least (one sequence of cache each)."""
        per_proc = (
            self.model.weights_bytes
            + PROC_OVERHEAD_BYTES
            + self.seq_tokens * self.kv_bytes_per_token
        )
        return self.procs * per_proc / GPU_MEMORY_USABLE


def model_size(model_dir: Path) -> ModelSize:
    """The weights' bytes and K/V elements per cached token of a model folder (OSError,
    ValueError or KeyError for a folder that does not say)."""
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return ModelSize(weights, 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim)


def gpu_memory(settings: WorkerSettings, gpu: str) -> int | None:
    """Bytes of `gpu` genq may fill: GENQ_GPU_MEMORY_GIB, else what is free there now."""
    if settings.gpu_memory_gib is not None:
        return int(settings.gpu_memory_gib * GIB)
    return free_memory_bytes(gpu)


def plan(settings: WorkerSettings, gpus: list[str], procs: int) -> Share | None:
    """The share of each of `procs` processes per GPU, on the GPU with the least memory; None
    where it cannot be planned: the sim engine, a model folder that does not say its size, a
    GPU whose memory nothing tells, a model split over several GPUs (GENQ_GPU_SPLIT)."""
    if settings.engine not in GPU_ENGINES or not settings.model_dir or settings.gpu_split:
        return None
    try:
        size = model_size(Path(settings.model_dir).expanduser())
    except (OSError, ValueError, KeyError):
        return None
    memory = [gpu_memory(settings, g) for g in gpus]
    if not memory or any(m is None for m in memory) or size.weights_bytes == 0:
        return None
    per_token = size.kv_per_token * CACHE_BYTES_PER_ELEMENT[settings.cache_mode]
    seq = loader.max_seq_len(settings) or PAGE_TOKENS
    seq_tokens = -(-seq // PAGE_TOKENS) * PAGE_TOKENS
    least = min(m for m in memory if m is not None)
    return Share(procs, least, size, per_token, seq_tokens)


def check_fits(settings: WorkerSettings, gpus: list[str], procs: int) -> Share | None:
    """The plan for `procs` processes per GPU; SystemExit with one line where they do not
    fit."""
    share = plan(settings, gpus, procs)
    if share is None or share.fits:
        return share
    where = "GENQ_GPU_MEMORY_GIB" if settings.gpu_memory_gib is not None else "free"
    seq_cache = share.seq_tokens * share.kv_bytes_per_token
    raise SystemExit(
        f"genq: error: {procs} worker process(es) of {Path(str(settings.model_dir)).name} do "
        f"not fit on GPU {','.join(gpus)}: they need {_gib(share.needed_bytes())} "
        f"({procs} x ({_gib(share.model.weights_bytes)} weights + "
        f"{_gib(PROC_OVERHEAD_BYTES)} per process + {_gib(seq_cache)} "
        f"cache for one {share.seq_tokens}-token sequence), {GPU_MEMORY_USABLE:.0%} of the "
        f"memory filled at most), the GPU has {_gib(share.memory_bytes)} ({where}); run fewer "
        "(--procs-per-gpu) or a smaller cache mode (--cache-mode)"
    )


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def process_cache_tokens(settings: EngineSettings, procs: int, share: Share | None) -> int:
    """One process's cache: its part of the GPU's (`--cache-tokens` divided by N, else room
    for its batch), no more than its share of the memory holds."""
    seq_len = loader.max_seq_len(settings) or 0
    wanted = cache_tokens(settings.cache_tokens, seq_len, settings.max_batch)
    per = max(PAGE_TOKENS, (wanted // procs) // PAGE_TOKENS * PAGE_TOKENS)
    if share is not None and share.cache_tokens < per:
        log.info(
            "cache sized to the process's share of the GPU",
            extra={"procs": procs, "cache_tokens": share.cache_tokens, "wanted": per},
        )
        return share.cache_tokens
    return per
