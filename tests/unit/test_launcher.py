"""`genq worker --gpus … --procs-per-gpu N`: shares, environment, restart and drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

import genq.launcher as launcher
from genq.launcher import Launcher, child_settings, parse_gpus, settings_env
from shared.settings import Settings
from tests.conftest import REDIS_URL
from tests.procs import free_port, wait_for


def test_each_process_gets_its_share_of_the_gpu() -> None:
    s = Settings(max_batch=256, cache_tokens=196_608)
    assert child_settings(s, 3) == {"max_batch": 86, "cache_tokens": 65_536}
    assert child_settings(s, 1) == {"max_batch": 256, "cache_tokens": 196_608}


def test_children_get_the_settings_their_gpu_and_an_id_each(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    s = Settings(
        engine="exllamav2",
        model_dir="/m",
        max_batch=64,
        cache_tokens=65_536,
        api_keys=["k"],
        worker_id="box",
    )
    la = Launcher(s, ["0", "1"], 2)
    envs = [c.env for c in la.children]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["GENQ_WORKER_ID"] for e in envs] == ["box-g0p0", "box-g0p1", "box-g1p0", "box-g1p1"]
    assert all(e["GENQ_MAX_BATCH"] == "32" and e["GENQ_CACHE_TOKENS"] == "32768" for e in envs)
    env = settings_env(s)
    assert env["GENQ_API_KEYS"] == '["k"]' and env["GENQ_MODEL_DIR"] == "/m"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rebuilt = Settings()
    assert rebuilt.api_keys == ["k"] and rebuilt.engine == "exllamav2"


def test_each_child_serves_its_probes_on_a_port_of_its_own() -> None:
    la = Launcher(Settings(metrics_port=9400), ["0", "1"], 2)
    assert [c.env["GENQ_METRICS_PORT"] for c in la.children] == ["9400", "9401", "9402", "9403"]


def test_gpus_default_to_the_visible_ones(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert parse_gpus("0, 2") == ["0", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert parse_gpus(None) == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert parse_gpus(None) == ["0"]


def test_a_dying_child_is_restarted_with_backoff(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(launcher, "RESTART_BACKOFF_S", 0.05)
    die = [sys.executable, "-c", "raise SystemExit(3)"]
    la = Launcher(Settings(shutdown_grace_s=1), ["0"], 1, command=die)
    la.children[0].backoff = 0.05
    t = threading.Thread(target=la.run_supervised)
    t.start()
    deadline = time.monotonic() + 10
    while la.children[0].restarts < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    la._stop()
    t.join(10)
    c = la.children[0]
    assert c.restarts >= 3 and set(c.exit_codes) == {3}
    assert c.backoff > 0.05 * 4  # doubled on every death


def test_sigterm_drains_every_child() -> None:
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0));"
        "print('up', flush=True); time.sleep(60)"
    )
    cmd = [sys.executable, "-c", code]
    la = Launcher(Settings(shutdown_grace_s=5), ["0", "1"], 2, command=cmd)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(la.run_supervised()))
    t.start()
    time.sleep(0.5)
    la._stop(signal.SIGTERM)
    t.join(10)
    assert result == [0]
    assert all(c.proc is not None and c.proc.returncode == 0 for c in la.children)


@pytest.mark.e2e
def test_serve_with_several_worker_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    env = {
        **os.environ,
        "GENQ_REDIS_URL": REDIS_URL,
        "PYTHONUNBUFFERED": "1",
        "GENQ_KEY_PREFIX": f"genqtest:{uuid.uuid4().hex[:8]}:",
        "GENQ_SIM_STEP_MS": "1",
    }
    with open(tmp_path / "serve.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "genq",
                "serve",
                "--port",
                str(port),
                "--procs-per-gpu",
                "2",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: httpx.get(f"{url}/v1/models").json()["data"][0]["workers"] == 2,
            timeout=30,
            what="two sim workers",
        )
        r = httpx.post(
            f"{url}/v1/jobs",
            json={"model": "sim", "prompt": "hi", "max_tokens": 5, "stream": True},
            timeout=10,
        )
        assert r.status_code == 200 and "event: done" in r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()[-2000:]


def _model(tmp_path, weight_gib: float):  # type: ignore[no-untyped-def]
    cfg = {
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(int(weight_gib * 1024**3))  # sparse: only the size matters
    return tmp_path


def test_auto_procs_fits_weights_cache_and_cores(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = _model(tmp_path, 15)
    monkeypatch.setattr(launcher, "_gpu_free_bytes", lambda gpu: 140 * 1024**3)
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 16)
    s = Settings(engine="exllamav2", model_dir=str(model), max_batch=256, cache_tokens=196_608)
    assert launcher.auto_procs(s, ["0"]) == 2  # 8B fp16 on an H200, GPU sampling: capped at 2
    cpu_sampled = s.model_copy(update={"gpu_sampling": False})
    assert launcher.auto_procs(cpu_sampled, ["0"]) == 4  # exllamav2's CPU sampler: 4
    assert launcher.auto_procs(cpu_sampled, ["0", "1"]) == 2  # 4 cores each, 16 for 2 GPUs
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 6)
    assert launcher.auto_procs(s, ["0"]) == 2
    assert launcher.auto_procs(s, ["0", "1"]) == 1  # 2 cores each: 6 CPUs carry 1 per GPU
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 16)
    big = _model(tmp_path, 130)  # a 70B-class model fits once
    assert launcher.auto_procs(s.model_copy(update={"model_dir": str(big)}), ["0"]) == 1
    monkeypatch.setattr(launcher, "_gpu_free_bytes", lambda gpu: None)  # no nvidia-smi
    assert launcher.auto_procs(s, ["0"]) == 1
    assert launcher.auto_procs(Settings(), ["0"]) == 1  # the sim engine
