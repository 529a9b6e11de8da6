"""`genq worker --gpus … --procs-per-gpu N`: shares, environment, restart and drain."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

import genq.gpu_share as gpu_share
import genq.launcher as launcher
from genq.launcher import Launcher, child_settings, parse_gpus, settings_env
from shared.keys import Keys
from shared.records import StoppedWorker
from shared.settings import Settings
from tests.conftest import REDIS_URL, test_prefix
from tests.procs import Cluster, free_port, wait_for
from worker.exl2 import loader


def test_each_process_gets_its_share_of_the_gpu() -> None:
    s = Settings(max_batch=256, cache_tokens=196_608)
    assert child_settings(s, 3) == {"max_batch": 86, "cache_tokens": 65_536}
    assert child_settings(s, 1) == {"max_batch": 256, "cache_tokens": 196_608}


def test_a_gpus_default_cache_is_what_its_engine_would_allocate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The launcher sizes the cache as a lone exllamav2 worker would: at least one sequence
    of the model's length (config.json), not only 1024 tokens per batch slot."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 131_072}))
    s = Settings(engine="exllamav2", model_dir=str(tmp_path), max_batch=4)
    engine_default = loader.cache_tokens(None, 131_072, 4)
    assert engine_default == 131_072
    assert child_settings(s, 1)["cache_tokens"] == engine_default
    assert child_settings(s, 2)["cache_tokens"] == engine_default // 2
    short = s.model_copy(update={"max_seq_len": 2048})  # GENQ_MAX_SEQ_LEN wins over the model's
    assert child_settings(short, 1)["cache_tokens"] == loader.cache_tokens(None, 2048, 4) == 4096


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


_GPU0_DIES = (
    "import os, signal, sys, time\n"
    "ready = os.environ.get('LAUNCHER_TEST_READY')\n"
    "if os.environ['CUDA_VISIBLE_DEVICES'] == '0':\n"
    "    while ready and not os.path.exists(ready):\n"
    "        time.sleep(0.01)\n"
    "    sys.exit(3)\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "if ready:\n"
    "    open(ready, 'w').close()\n"
    "time.sleep(60)\n"
)
"""A child command: on GPU 0 it exits with 3 (once the file LAUNCHER_TEST_READY names exists,
if it names one); elsewhere it runs until SIGTERM (and makes that file once it would drain)."""


def _supervise(la: Launcher, timeout: float) -> int | None:
    """`la.run_supervised()` in a thread; its exit code, or None while it still runs after
    `timeout` (then it is stopped)."""
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(la.run_supervised()))
    t.start()
    t.join(timeout)
    if t.is_alive():
        la._stop()
        t.join(30)
        return None
    return result[0]


def _fast_restarts(la: Launcher, backoff: float) -> None:
    for c in la.children:
        c.backoff = backoff


@pytest.mark.parametrize("limit", [3, 0])
def test_a_crash_loop_stops_that_child_alone(limit: int, tmp_path: Path) -> None:
    """The child on GPU 0 dies at every start; the one on GPU 1 serves on. The launcher gives
    up on the first alone, says so in Redis (the gateways' /readyz shows it), keeps the other
    running, and once stopped exits non-zero (a child of its set was lost)."""
    prefix = test_prefix()
    s = Settings(
        restart_limit=limit,
        restart_window_s=60,
        shutdown_grace_s=5,
        redis_url=REDIS_URL,
        key_prefix=prefix,
        worker_id="box",
    )
    la = Launcher(s, ["0", "1"], 1, command=[sys.executable, "-c", _GPU0_DIES])
    _fast_restarts(la, 0.05)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(la.run_supervised()))
    t.start()
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    stopped_key = Keys(prefix).stopped_workers()
    try:
        dying, healthy = la.children
        wait_for(lambda: r.hexists(stopped_key, "box-g0p0"), timeout=30, what="the report")
        entry = StoppedWorker.decode(r.hget(stopped_key, "box-g0p0") or "")
        assert entry.model == "sim" and entry.gpu == "0" and entry.exit_codes == [3] * (limit + 1)
        assert la.crash_loop is dying and dying.restarts == limit
        time.sleep(0.5)  # the launcher goes on supervising: the healthy child is left alone
        assert t.is_alive() and not la.stopping
        assert healthy.proc is not None and healthy.proc.poll() is None and healthy.restarts == 0
    finally:
        la._stop()
        t.join(30)
    assert result == [launcher.CRASH_LOOP_EXIT]
    assert healthy.proc is not None and healthy.proc.returncode == 0  # drained by SIGTERM
    assert not r.hexists(stopped_key, "box-g0p0")  # the launcher gone: no longer its to say
    r.close()


def test_once_every_child_crash_loops_the_launcher_exits_non_zero() -> None:
    die = [sys.executable, "-c", "raise SystemExit(3)"]
    s = Settings(restart_limit=1, restart_window_s=60, shutdown_grace_s=5)
    la = Launcher(s, ["0", "1"], 1, command=die)
    _fast_restarts(la, 0.05)
    assert _supervise(la, timeout=30) == launcher.CRASH_LOOP_EXIT
    assert all(c.stopped_at is not None and c.exit_codes == [3, 3] for c in la.children)


def test_crashes_spread_out_keep_being_restarted(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    backoff = 0.3  # every restart this long after the death before it...
    monkeypatch.setattr(launcher, "RESTART_BACKOFF_MAX_S", backoff)
    s = Settings(restart_limit=1, restart_window_s=0.2, shutdown_grace_s=1)  # ...past the window
    la = Launcher(s, ["0"], 1, command=[sys.executable, "-c", _GPU0_DIES])
    _fast_restarts(la, backoff)
    t = threading.Thread(target=la.run_supervised)
    t.start()
    try:
        wait_for(lambda: la.children[0].restarts >= 4 or not t.is_alive(), timeout=30)
    finally:
        la._stop()
        t.join(30)
    assert la.crash_loop is None and la.children[0].restarts >= 4


@pytest.mark.e2e
def test_genq_worker_exits_non_zero_when_its_processes_crash_loop() -> None:
    """The real command: sim workers that die at start (their health port is taken)."""
    with _held_ports(2) as port:
        env = {
            **os.environ,
            "GENQ_REDIS_URL": REDIS_URL,
            "GENQ_KEY_PREFIX": test_prefix(),
            "GENQ_RESTART_LIMIT": "1",
            "GENQ_RESTART_WINDOW_S": "120",
            "GENQ_METRICS_PORT": str(port),  # the launcher's Nth process takes port + N
        }
        cmd = [sys.executable, "-m", "genq", "worker", "--procs-per-gpu", "2"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == launcher.CRASH_LOOP_EXIT, out.stderr[-2000:]
    assert "keeps dying" in out.stderr


@pytest.mark.e2e
def test_a_crash_looping_process_leaves_the_others_serving(tmp_path: Path) -> None:
    """The real commands: `genq worker --procs-per-gpu 2` (sim), whose second process dies at
    every start (its health port is taken), and a gateway. The first serves on: a job runs,
    and /readyz says the model lost one of its two processes and which."""
    prefix = test_prefix()
    with _held_ports(1, skip=1) as port:  # port + 1 held: the second process cannot start
        env = {
            **os.environ,
            "GENQ_REDIS_URL": REDIS_URL,
            "GENQ_KEY_PREFIX": prefix,
            "GENQ_RESTART_LIMIT": "1",
            "GENQ_RESTART_WINDOW_S": "120",
            "GENQ_METRICS_PORT": str(port),  # the launcher's Nth process takes port + N
            "GENQ_WORKER_ID": "box",
        }
        cmd = [sys.executable, "-m", "genq", "worker", "--procs-per-gpu", "2"]
        log = tmp_path / "launcher.log"
        with open(log, "wb") as out:
            workers = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        cluster = Cluster(REDIS_URL, tmp_path, prefix)
        try:
            gw = cluster.gateway()
            ready = lambda: httpx.get(f"{gw.url}/readyz", timeout=5).json()  # noqa: E731
            wait_for(
                lambda: ready()["capacity"]["sim"] == {"workers": 1, "stopped": 1},
                timeout=60,
                what=f"one process serving, one stopped: {log.read_text()[-2000:]}",
            )
            [stopped] = ready()["stopped_workers"]
            assert stopped["worker_id"] == "box-g0p1" and stopped["model"] == "sim"
            assert ready()["models"] == {"sim": True}
            r = httpx.post(
                f"{gw.url}/v1/jobs",
                json={"model": "sim", "prompt": "still here?", "max_tokens": 4, "stream": True},
                timeout=30,
            )
            assert r.status_code == 200 and "event: done" in r.text
            assert workers.poll() is None  # the launcher goes on, with its healthy process
            assert "keeps dying: stopped it; 1 other(s) go on" in log.read_text()
        finally:
            workers.send_signal(signal.SIGTERM)
            code = workers.wait(60)
            cluster.close()
    assert code == launcher.CRASH_LOOP_EXIT  # stopped, it says a process of its set was lost


@contextlib.contextmanager
def _held_ports(n: int, skip: int = 0) -> Iterator[int]:
    """A free local port; the `n` after its first `skip` successors are listened on (so
    nothing else can bind them)."""
    for _ in range(50):
        first = free_port()
        socks: list[socket.socket] = []
        try:
            for i in range(skip, skip + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", first + i))
                s.listen()
        except OSError:
            for s in socks:
                s.close()
            continue
        try:
            yield first
        finally:
            for s in socks:
                s.close()
        return
    raise RuntimeError("no run of free ports")


def test_sigterm_drains_every_child(tmp_path: Path) -> None:
    """Each child says when its SIGTERM handler is in (a file): the drain must find them all
    ready, or a child still starting would die of the signal instead of draining."""
    code = (
        "import os, pathlib, signal, sys, time;"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0));"
        "pathlib.Path(os.environ['READY_DIR'], str(os.getpid())).touch(); time.sleep(60)"
    )
    cmd = [sys.executable, "-c", code]
    os.environ["READY_DIR"] = str(tmp_path)
    try:
        la = Launcher(Settings(shutdown_grace_s=5), ["0", "1"], 2, command=cmd)
    finally:
        del os.environ["READY_DIR"]
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(la.run_supervised()))
    t.start()
    wait_for(lambda: len(list(tmp_path.iterdir())) == 4, timeout=30, what="4 children ready")
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
        "GENQ_KEY_PREFIX": test_prefix(),
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
    monkeypatch.setattr(gpu_share, "free_memory_bytes", lambda gpu: 140 * 1024**3)
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 16)
    s = Settings(engine="exllamav2", model_dir=str(model), max_batch=256, cache_tokens=196_608)
    assert launcher.auto_procs(s, ["0"]) == 1  # 8B fp16 on an H200, GPU sampling: capped at 1
    assert launcher.auto_procs(s.model_copy(update={"auto_procs_max": 2}), ["0"]) == 2
    assert launcher.auto_procs(s.model_copy(update={"auto_procs_max": 3}), ["0"]) == 3
    cpu_sampled = s.model_copy(update={"gpu_sampling": False})
    assert launcher.auto_procs(cpu_sampled, ["0"]) == 4  # exllamav2's CPU sampler: 4
    assert launcher.auto_procs(cpu_sampled, ["0", "1"]) == 2  # 4 cores each, 16 for 2 GPUs
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 6)
    two = s.model_copy(update={"auto_procs_max": 2})
    assert launcher.auto_procs(two, ["0"]) == 2
    assert launcher.auto_procs(two, ["0", "1"]) == 1  # 2 cores each: 6 CPUs carry 1 per GPU
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 16)
    big = _model(tmp_path, 130)  # a 70B-class model fits once
    assert launcher.auto_procs(s.model_copy(update={"model_dir": str(big)}), ["0"]) == 1
    monkeypatch.setattr(gpu_share, "free_memory_bytes", lambda gpu: None)  # no NVML, nvidia-smi
    assert launcher.auto_procs(s, ["0"]) == 1
    assert launcher.auto_procs(Settings(), ["0"]) == 1  # the sim engine


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_the_help_says_how_many_processes_auto_picks(command: str, capsys) -> None:  # type: ignore[no-untyped-def]
    from genq.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    most, most_cpu = launcher.AUTO_MAX_PROCS, launcher.AUTO_MAX_PROCS_CPU_SAMPLING
    assert f"at most {most}; {most_cpu} without GPU sampling" in text
