"""`genq worker --gpus … --procs-per-gpu N`: shares, environment, restart and drain."""

from __future__ import annotations

import signal
import sys
import threading
import time

import worker.launcher as launcher
from shared.settings import Settings
from worker.launcher import Launcher, child_settings, parse_gpus, settings_env


def test_each_process_gets_its_share_of_the_gpu() -> None:
    s = Settings(max_batch=256, cache_tokens=196_608)
    assert child_settings(s, 3) == {"max_batch": 86, "cache_tokens": 65_536}
    assert child_settings(s, 1) == {"max_batch": 256, "cache_tokens": 196_608}


def test_children_get_the_settings_their_gpu_and_an_id_each(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    s = Settings(engine="exllamav2", model_dir="/m", max_batch=64, cache_tokens=65_536,
                 api_keys=["k"], worker_id="box")
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
