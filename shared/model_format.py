"""Which engine reads a model folder: EXL3 → exllamav3, EXL2 → exllamav2, plain fp16/bf16 →
the faster of the two (`PLAIN_FOLDER_ENGINE`). Read from the folder's files alone (no GPU
library), so a settings object can decide it when `--model` is given without `--engine`.

exllamav3 reads plain Hugging Face folders and EXL3, not EXL2; exllamav2 reads plain folders
and EXL2 (and GPTQ), not EXL3. A conversion names its format in config.json's
`quantization_config.quant_method`; EXL2 folders converted before exllamav2 wrote that key are
known by their tensors (`*.q_weight`), EXL3 ones by theirs (`*.trellis`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Literal

ModelEngine = Literal["exllamav2", "exllamav3"]
FolderFormat = Literal["exl2", "exl3", "plain", "other"]

PLAIN_FOLDER_ENGINE: ModelEngine = "exllamav2"
"""The engine for a plain fp16/bf16 folder, which both read: the faster one on the GPU
benchmark (docs/performance.md, "GPU: exllamav3"): exllamav2's worker did 1.26-1.58 x
the tokens/s of exllamav3's on the fp16 8B at 1 to 256 streams (exllamav3's graph-captured
decode runs only for EXL3 projections)."""

FORMAT_ENGINES: dict[FolderFormat, ModelEngine] = {
    "exl2": "exllamav2",
    "exl3": "exllamav3",
    "plain": PLAIN_FOLDER_ENGINE,
    "other": "exllamav2",  # GPTQ and the like: exllamav2 reads GPTQ, exllamav3 does not
}
QUANT_METHODS: dict[str, FolderFormat] = {"exl2": "exl2", "exl3": "exl3"}
TENSOR_SUFFIXES: dict[str, FolderFormat] = {".q_weight": "exl2", ".trellis": "exl3"}
"""Tensor names only one format has, for folders whose config.json does not say."""
MAX_HEADER_BYTES = 64 * 1024**2
"""A safetensors header longer than this is not read (no real checkpoint's is)."""
SAFETENSORS_LENGTH = struct.Struct("<Q")


def engine_for_folder(model_dir: str | Path) -> ModelEngine:
    return FORMAT_ENGINES[folder_format(model_dir)]


def folder_format(model_dir: str | Path) -> FolderFormat:
    """The format of a model folder; `plain` when nothing says it is quantized (also for a
    folder that cannot be read: the engine's own checks name what is wrong with it)."""
    folder = Path(model_dir).expanduser()
    qcfg = _read_json(folder / "config.json").get("quantization_config")
    if isinstance(qcfg, dict) and qcfg.get("quant_method") is not None:
        return QUANT_METHODS.get(str(qcfg["quant_method"]).lower(), "other")
    for name in _tensor_names(folder):
        for suffix, fmt in TENSOR_SUFFIXES.items():
            if name.endswith(suffix):
                return fmt
    return "plain"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _tensor_names(folder: Path) -> list[str]:
    """Tensor names from the shard index, else from the first shard's header."""
    weight_map = _read_json(folder / "model.safetensors.index.json").get("weight_map")
    if isinstance(weight_map, dict):
        return [str(k) for k in weight_map]
    shards = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return _header_names(shards[0]) if shards else []


def _header_names(path: Path) -> list[str]:
    try:
        with path.open("rb") as f:
            (length,) = SAFETENSORS_LENGTH.unpack(f.read(SAFETENSORS_LENGTH.size))
            if length > MAX_HEADER_BYTES:
                return []
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error):
        return []
    return [str(k) for k in header if k != "__metadata__"] if isinstance(header, dict) else []
