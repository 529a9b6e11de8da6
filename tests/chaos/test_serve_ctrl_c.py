"""Ctrl-C on `genq serve`, as a terminal sends it: SIGINT to the whole foreground process group.
Once, it drains like SIGTERM: open streams end with their `done`, the private redis-server and
the engine stop last, and the process exits 0 without a traceback; a stream whose job outlasts
the grace ends with a `server_stopping` end (native: an `error` event saying whether the job
resumes; OpenAI: an error object, then `[DONE]`) before its connection closes. Twice, it stops
at once, every stream still ending with its end event."""

from __future__ import annotations

import contextlib
import json
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
"""The second Ctrl-C: the process has exited within this of it; the grace running out: within
this of its end."""
GRACE_S = 2.0
"""GENQ_SHUTDOWN_GRACE_S where the streams outlast it."""
LONG_TOKENS = 3000
"""A minute of tokens: no grace ends such a stream with its job."""
READY_WITHIN_S = 60.0
MODES = pytest.mark.parametrize(
    "args", [[], ["--procs-per-gpu", "2"]], ids=["one-process", "worker-processes"]
)


@contextlib.contextmanager
def serve_in_a_terminal(
    tmp_path: Path, args: list[str], grace_s: float = 15.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`genq serve --ephemeral` leading a process group of its own, as a shell runs a command
    in the foreground; killed with everything it started at the end. By default a grace well
    past the drain's bound, so that the bound is what is checked."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "serve", "--port", str(port), "--ephemeral", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean_env(GENQ_SIM_STEP_MS="20", GENQ_SHUTDOWN_GRACE_S=str(grace_s)),
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


def open_streams(
    url: str, max_tokens: int, chat: int = 0
) -> tuple[list[threading.Thread], dict[int, list[str]]]:
    """STREAMS native job streams and `chat` OpenAI chat streams, each recording its SSE
    lines (`event:` and `data:`), or how it was cut."""
    lines: dict[int, list[str]] = {}

    def stream(i: int) -> None:
        body: dict[str, object] = {"model": "sim", "max_tokens": max_tokens, "stream": True}
        route = "/v1/jobs"
        if i < STREAMS:
            body["prompt"] = "hello"
        else:
            body["messages"] = [{"role": "user", "content": "hello"}]
            route = "/v1/chat/completions"
        seen = lines.setdefault(i, [])
        try:
            with httpx.stream("POST", f"{url}{route}", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith(("event:", "data:")):
                        seen.append(line)
        except httpx.HTTPError as exc:
            seen.append(f"cut: {type(exc).__name__}")

    n = STREAMS + chat
    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    wait_for(lambda: all(len(lines.get(i, [])) > 2 for i in range(n)), 30, what="every stream")
    return threads, lines


def last_event(lines: list[str]) -> str:
    """The type of a native stream's last event (or how it was cut)."""
    events = [x.removeprefix("event:").strip() for x in lines if not x.startswith("data:")]
    return events[-1]


def stopped_end(lines: list[str]) -> dict[str, object]:
    """A native stream's last event, which must be the `server_stopping` end."""
    assert last_event(lines) == "error", lines[-3:]
    end = json.loads(lines[-1].removeprefix("data:"))
    assert end["code"] == "server_stopping", end
    return dict(end)


def assert_chat_told(lines: list[str]) -> None:
    """An OpenAI stream's end: an error object with the code, then `[DONE]`."""
    *_, error, done = lines
    assert done == "data: [DONE]", lines[-3:]
    assert json.loads(error.removeprefix("data:"))["error"]["code"] == "server_stopping"


def ctrl_c(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGINT)


@needs_redis_server
@MODES
def test_one_ctrl_c_drains_the_streams_and_stops_redis_last(
    tmp_path: Path, args: list[str]
) -> None:
    with serve_in_a_terminal(tmp_path, args) as (url, proc):
        tree = psutil.Process(proc.pid).children(recursive=True)
        threads, lines = open_streams(url, max_tokens=60)  # ~1.2 s of tokens each
        t0 = time.monotonic()
        ctrl_c(proc)
        for t in threads:
            t.join(DRAINED_WITHIN_S)
        assert {i: last_event(seen) for i, seen in lines.items()} == dict.fromkeys(
            range(STREAMS), "done"
        )
        assert proc.wait(DRAINED_WITHIN_S) == 0
        assert time.monotonic() - t0 < DRAINED_WITHIN_S
        wait_for(lambda: not [p for p in tree if running(p)], 5, what="every child gone")
    assert "Traceback" not in (tmp_path / "serve.log").read_text(errors="replace")


@needs_redis_server
@MODES
def test_streams_longer_than_the_grace_end_with_server_stopping(
    tmp_path: Path, args: list[str]
) -> None:
    with serve_in_a_terminal(tmp_path, args, grace_s=GRACE_S) as (url, proc):
        threads, lines = open_streams(url, LONG_TOKENS, chat=1)
        t0 = time.monotonic()
        ctrl_c(proc)
        assert proc.wait(GRACE_S + STOPPED_WITHIN_S + 1) == 0
        assert time.monotonic() - t0 < GRACE_S + STOPPED_WITHIN_S
        for t in threads:
            t.join(1)
        for i in range(STREAMS):  # cancel_on_disconnect is off: the job goes on later
            assert stopped_end(lines[i])["resumes"] is True
        assert_chat_told(lines[STREAMS])
    said = (tmp_path / "serve.log").read_text(errors="replace")
    assert f"stopping: waiting up to {GRACE_S:g} s for {STREAMS + 1} open streams" in said
    assert "Traceback" not in said


@needs_redis_server
@MODES
def test_a_second_ctrl_c_stops_at_once(tmp_path: Path, args: list[str]) -> None:
    with serve_in_a_terminal(tmp_path, args) as (url, proc):
        tree = psutil.Process(proc.pid).children(recursive=True)
        threads, lines = open_streams(url, LONG_TOKENS, chat=1)
        ctrl_c(proc)
        time.sleep(0.3)
        t0 = time.monotonic()
        ctrl_c(proc)
        proc.wait(STOPPED_WITHIN_S + 1)
        assert time.monotonic() - t0 < STOPPED_WITHIN_S
        for t in threads:
            t.join(1)
        for i in range(STREAMS):
            stopped_end(lines[i])
        assert_chat_told(lines[STREAMS])
        wait_for(lambda: not [p for p in tree if running(p)], 5, what="every child gone")
    assert "Traceback" not in (tmp_path / "serve.log").read_text(errors="replace")
