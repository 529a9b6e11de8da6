"""`genq worker` pointed at a Redis that never answers: it says so every few seconds and
gives up, exiting non-zero, after GENQ_REDIS_START_TIMEOUT_S — whatever the socket timeouts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.service import WAITING_LINE_S

pytestmark = pytest.mark.e2e

GIVE_UP_S = WAITING_LINE_S + 1.0
"""Past one "waiting" line."""
START_SLACK_S = 20.0
"""The sim engine's process start and the interpreter's imports, on a loaded machine."""


def test_a_worker_whose_redis_never_answers_gives_up_in_time(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
        env |= {"GENQ_REDIS_START_TIMEOUT_S": str(GIVE_UP_S), "GENQ_ENGINE_PROCESS": "false"}
        args = ["worker", "--engine", "sim", "--redis-url", f"redis://127.0.0.1:{port}/0"]
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "genq", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=GIVE_UP_S + START_SLACK_S,
        )
        took = time.monotonic() - began
    assert done.returncode == 1, done.stderr[-2000:]
    assert took >= GIVE_UP_S
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    waiting = [r for r in records if r["msg"] == "waiting for Redis to answer before starting"]
    assert waiting and all(r["level"] == "warning" for r in waiting), done.stderr[-2000:]
    assert waiting[0]["redis"] == f"127.0.0.1:{port}/0" and waiting[0]["gives_up_in_s"] < GIVE_UP_S
    [gave_up] = [r for r in records if r["msg"] == "giving up: Redis never answered"]
    assert gave_up["level"] == "error" and gave_up["limit_s"] == GIVE_UP_S
