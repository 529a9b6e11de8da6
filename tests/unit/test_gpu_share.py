"""Worker processes sharing one GPU: each process's cache is sized to its share of the memory
(weights counted once per process) before any starts, and where N processes cannot fit,
`genq worker` and `genq serve` refuse at start in one line. The GPU's memory is given as
GENQ_GPU_MEMORY_GIB (no GPU here); the model is a folder with an 8B model's config and a
sparse weights file of an 8B fp16 model's size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from genq.gpu_share import (
    GIB,
    GPU_MEMORY_USABLE,
    PROC_OVERHEAD_BYTES,
    check_fits,
)
from genq.launcher import Launcher, child_settings
from shared.settings import Settings
from tests.conftest import REDIS_URL, test_prefix

H100_GIB = 80.0
WEIGHTS_BYTES = 16 * GIB
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 8192,
    "torch_dtype": "float16",
}
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, layers, heads, head dim, fp16


@pytest.fixture
def m8b(tmp_path: Path) -> Path:
    folder = tmp_path / "M8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(WEIGHTS_BYTES)  # sparse: its size, no disk
    return folder


def _settings(model: Path, **more: object) -> Settings:
    return Settings(
        engine="exllamav2", model_dir=str(model), gpu_memory_gib=H100_GIB, max_batch=256, **more
    )


def test_each_of_n_processes_gets_a_cache_its_share_of_the_memory_holds(m8b: Path) -> None:
    s = _settings(m8b)
    share = check_fits(s, ["0"], 3)
    assert share is not None and share.fits
    cache = child_settings(s, 3, share)["cache_tokens"]
    # three copies of the weights, three processes' overhead, three caches: within the GPU
    used = 3 * (WEIGHTS_BYTES + PROC_OVERHEAD_BYTES + cache * KV_BYTES_PER_TOKEN)
    assert used <= H100_GIB * GIB * GPU_MEMORY_USABLE
    assert cache >= (H100_GIB * GIB * GPU_MEMORY_USABLE - used) // KV_BYTES_PER_TOKEN // 3 - 256
    assert cache % 256 == 0 and cache >= LLAMA_8B["max_position_embeddings"]
    # the processes of the launcher are given that cache, each
    la = Launcher(s, ["0"], 3, memory=share)
    assert {c.env["GENQ_CACHE_TOKENS"] for c in la.children} == {str(cache)}


def test_a_share_larger_than_wanted_keeps_the_wanted_cache(m8b: Path) -> None:
    s = _settings(m8b, cache_tokens=65_536)
    share = check_fits(s, ["0"], 2)
    assert child_settings(s, 2, share)["cache_tokens"] == 32_768  # the GPU's, halved


@pytest.mark.parametrize("procs", [4, 5])
def test_n_that_cannot_fit_is_refused_in_one_line(m8b: Path, procs: int) -> None:
    with pytest.raises(SystemExit) as stop:
        check_fits(_settings(m8b), ["0"], procs)
    line = str(stop.value)
    assert "\n" not in line and line.startswith(f"genq: error: {procs} worker process(es)")
    need = procs * (WEIGHTS_BYTES + PROC_OVERHEAD_BYTES + 8192 * KV_BYTES_PER_TOKEN)
    assert f"need {need / GPU_MEMORY_USABLE / GIB:.1f} GiB" in line
    assert f"has {H100_GIB:.1f} GiB" in line


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_genq_refuses_at_start_when_the_processes_cannot_fit(m8b: Path, command: str) -> None:
    env = {
        **os.environ,
        "GENQ_REDIS_URL": REDIS_URL,
        "GENQ_KEY_PREFIX": test_prefix(),
        "GENQ_GPU_MEMORY_GIB": str(H100_GIB),
    }
    args = ["--engine", "exllamav2", "--model", str(m8b), "--procs-per-gpu", "4"]
    if command == "serve":
        args += ["--port", "0", "--ephemeral"]
    out = subprocess.run(
        [sys.executable, "-m", "genq", command, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    [line] = [x for x in out.stderr.splitlines() if x.startswith("genq: error:")]
    assert "4 worker process(es) of M8B do not fit on GPU 0" in line
    assert f"the GPU has {H100_GIB:.1f} GiB" in line
