"""What the launcher asks of a GPU before any model is loaded: its free memory (how many
worker processes fit) and its PCI address (which NUMA node, for CPU placement).

NVML (the `pynvml` module of nvidia-ml-py, in the `gpu` extra) answers when it is importable
and initialises; otherwise `nvidia-smi`; when neither answers, None.

A GPU is named as the user or CUDA_VISIBLE_DEVICES names it: an index, or a UUID (`GPU-…`,
`MIG-…`). An index is taken as NVML's (nvidia-smi's) numbering. That is the numbering of the
indices a launcher receives from the user or its own CUDA_VISIBLE_DEVICES — they name physical
GPUs — and it matches CUDA's own order when CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA's default,
fastest first, can differ on hosts with mixed GPUs: name GPUs by UUID there).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
UUID_PREFIXES = ("GPU-", "MIG-")
SMI_TIMEOUT_S = 10
MIB = 1024**2


def free_memory_bytes(gpu: str) -> int | None:
    """Bytes of memory free on `gpu` now, or None when nothing can tell."""
    free = _nvml(gpu, lambda nvml, handle: int(nvml.nvmlDeviceGetMemoryInfo(handle).free))
    if free is not None:
        return free
    mib = smi_query(gpu, "memory.free")
    try:
        return int((mib or "").split()[0]) * MIB
    except (ValueError, IndexError):
        return None


def pci_bus_id(gpu: str) -> str | None:
    """`gpu`'s PCI address as NVML and nvidia-smi write it (`00000000:1B:00.0`), or None."""
    bus = _nvml(gpu, lambda nvml, handle: _text(nvml.nvmlDeviceGetPciInfo(handle).busId))
    return bus or smi_query(gpu, "pci.bus_id") or None


def smi_query(gpu: str, field: str) -> str | None:
    """One `nvidia-smi --query-gpu` field of one GPU (no header, no units), or None when
    nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", gpu],
            capture_output=True,
            text=True,
            timeout=SMI_TIMEOUT_S,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def _nvml(gpu: str, query: Callable[[Any, Any], T]) -> T | None:
    """`query(pynvml, handle of gpu)` between nvmlInit and nvmlShutdown; None when pynvml is
    not installed, NVML does not start (no driver), or it does not know the GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unavailable: %s", exc)
        return None
    try:
        handle = _handle(pynvml, gpu)
        return None if handle is None else query(pynvml, handle)
    except pynvml.NVMLError as exc:
        log.debug("NVML query failed", extra={"gpu": gpu, "error": str(exc)})
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _handle(nvml: Any, gpu: str) -> Any:
    name = gpu.strip()
    if name.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(name))
    if name.startswith(UUID_PREFIXES):
        return nvml.nvmlDeviceGetHandleByUUID(name)
    return None


def _text(v: Any) -> str:
    """NVML strings are bytes in older nvidia-ml-py releases, str in newer ones."""
    return v.decode() if isinstance(v, bytes) else str(v)
