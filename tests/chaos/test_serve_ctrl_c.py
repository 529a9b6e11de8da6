"""Ctrl-C on `genq serve`, as a terminal sends it: SIGINT to the whole foreground process group.
Once, it drains like SIGTERM: open streams end with their `done`, the private redis-server and
the engine stop last, and the process exits 0 without a traceback. Twice, it stops at once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.chaos.test_process_tree import clean_env, needs_redis_server, running
from tests.procs import free_port, wait_for

STREAMS = 4
DRAINED_WITHIN_S = 5.0
"""The first Ctrl-C: every stream has its `done` and the process has exited within this."""
STOPPED_WITHIN_S = 2.0
"""The second Ctrl-C: the process has exited within this of it."""
READY_WITHIN_S = 60.0
MODES = pytest.mark.parametrize(
    "args", [[], ["--procs-per-gpu", "2"]], ids=["one-process", "worker-processes"]
)


@contextlib.contextmanager
def serve_in_a_terminal(
    tmp_path: Path, args: list[str]
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`genq serve --ephemeral` leading a process group of its own, as a shell runs a command
    in the foreground; killed with everything it started at the end."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "serve", "--port", str(port), "--ephemeral", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            # a grace well past the drain's bound, as the default (30 s) is: the bound is checked
            env=clean_env(GENQ_SIM_STEP_MS="20", GENQ_SHUTDOWN_GRACE_S="15"),
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    tree: list[psutil.Process] = []
    try:
        wait_for(lambda: "sim" in httpx.get(f"{url}/v1/models", timeout=1).text, READY_WITHIN_S)
        tree = psutil.Process(proc.pid).children(recursive=True)
        yield url, proc
    finally:
        with contextlib.suppress(psutil.Error):
            tree += psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.wait()
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()
        print(log.read_text(errors="replace")[-3000:])


def open_streams(url: str, max_tokens: int) -> tuple[list[threading.Thread], dict[int, str]]:
    """STREAMS native job streams, each recording the type of its last event."""
    last: dict[int, str] = {}

    def stream(i: int) -> None:
        body = {"model": "sim", "prompt": "hello", "max_tokens": max_tokens, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/jobs", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        last[i] = line.removeprefix("event:").strip()
        except httpx.HTTPError as exc:
            last[i] = f"cut: {type(exc).__name__}"

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    wait_for(lambda: len(last) == STREAMS, 10, what="every stream's first event")
    return threads, last


def ctrl_c(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGINT)


@needs_redis_server
@MODES
def test_one_ctrl_c_drains_the_streams_and_stops_redis_last(
    tmp_path: Path, args: list[str]
) -> None:
    with serve_in_a_terminal(tmp_path, args) as (url, proc):
        tree = psutil.Process(proc.pid).children(recursive=True)
        threads, last = open_streams(url, max_tokens=60)  # ~1.2 s of tokens each
        t0 = time.monotonic()
        ctrl_c(proc)
        for t in threads:
            t.join(DRAINED_WITHIN_S)
        assert last == dict.fromkeys(range(STREAMS), "done")
        assert proc.wait(DRAINED_WITHIN_S) == 0
        assert time.monotonic() - t0 < DRAINED_WITHIN_S
        wait_for(lambda: not [p for p in tree if running(p)], 5, what="every child gone")
    assert "Traceback" not in (tmp_path / "serve.log").read_text(errors="replace")


@needs_redis_server
@MODES
def test_a_second_ctrl_c_stops_at_once(tmp_path: Path, args: list[str]) -> None:
    with serve_in_a_terminal(tmp_path, args) as (url, proc):
        tree = psutil.Process(proc.pid).children(recursive=True)
        open_streams(url, max_tokens=3000)  # a minute of tokens: no drain ends them in time
        ctrl_c(proc)
        time.sleep(0.3)
        t0 = time.monotonic()
        ctrl_c(proc)
        proc.wait(STOPPED_WITHIN_S + 1)
        assert time.monotonic() - t0 < STOPPED_WITHIN_S
        wait_for(lambda: not [p for p in tree if running(p)], 5, what="every child gone")
