"""Logs of real `genq` processes with stderr not a terminal: every process genq starts (uvicorn's
gateway processes, the launcher's workers, `genq serve`'s children) writes one JSON object per
line, uvicorn's own lines included; `GENQ_LOG_FORMAT=text` writes human lines with the fields."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REDIS_URL
from tests.prefixes import test_prefix
from tests.procs import Proc, free_port, wait_for

pytestmark = pytest.mark.e2e

PUBSUB_DOWN = "pub/sub connect failed; retrying"
STOP_TIMEOUT_S = 15.0
TZ_OFFSET = timedelta(hours=5, minutes=30)
TZ_POSIX = "GENQTEST-05:30"
"""A POSIX TZ of UTC+05:30 (no tzdata needed): text timestamps must be in it, not in UTC."""
CLOCK_SLACK = timedelta(minutes=2)


def _genq(tmp_path: Path, *args: str, **env: str) -> Proc:
    """`python -m genq ARGS` with stderr into a file (not a terminal); no GENQ_* from outside."""
    log = tmp_path / f"{args[0]}-{uuid.uuid4().hex[:6]}.stderr"
    base = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    with open(log, "ab") as err:  # append: the processes it starts share the file
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**base, "PYTHONUNBUFFERED": "1", "GENQ_SHUTDOWN_GRACE_S": "2", **env},
        )
    return Proc(args[0], proc, log)


def _lines(p: Proc) -> list[str]:
    """Complete lines so far (the last may still be being written)."""
    return [line for line in p.output().split("\n")[:-1] if line.strip()]


def _records(p: Proc) -> list[dict[str, Any]]:
    """Every line as JSON: a line that is not raises."""
    return [json.loads(line) for line in _lines(p)]


def _pids(records: list[dict[str, Any]], msg: str) -> set[int]:
    return {r["process"] for r in records if r["msg"] == msg}


def _unreachable_redis() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def _stopped(p: Proc) -> None:
    """SIGTERM, so that a parent stops its children before leaving."""
    p.stop(STOP_TIMEOUT_S)


@pytest.mark.contract
def test_gateway_processes_log_json_with_their_fields(tmp_path: Path) -> None:
    p = _genq(
        tmp_path,
        "gateway",
        "--workers",
        "2",
        "--port",
        str(free_port()),
        GENQ_REDIS_URL=_unreachable_redis(),
    )
    try:
        wait_for(
            lambda: len(_pids(_records(p), PUBSUB_DOWN)) == 2,
            what=f"both gateway processes' pub/sub warning as JSON: {p.output()[-800:]}",
        )
    finally:
        _stopped(p)
    records = _records(p)
    warned = [r for r in records if r["msg"] == PUBSUB_DOWN]
    assert all(r["logger"] == "gateway.pubsub_wire" and r["level"] == "warning" for r in warned)
    assert all(isinstance(r["error"], str) and r["error"] for r in warned)
    workers = _pids(records, PUBSUB_DOWN)
    assert p.proc.pid not in workers  # uvicorn's spawned processes, not the one we started
    started = {
        r["process"]
        for r in records
        if r["logger"] == "uvicorn.error" and r["msg"].startswith("Started server process")
    }
    assert started == workers
    assert all(isinstance(r["ts"], float) for r in records)


def test_text_format_is_human_lines_in_local_time_with_the_fields(tmp_path: Path) -> None:
    p = _genq(
        tmp_path,
        "gateway",
        "--workers",
        "2",
        "--port",
        str(free_port()),
        GENQ_REDIS_URL=_unreachable_redis(),
        GENQ_LOG_FORMAT="text",
        TZ=TZ_POSIX,
    )
    line = re.compile(
        r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) WARNING \[(?P<pid>\d+)\] "
        r"gateway\.pubsub_wire: " + re.escape(PUBSUB_DOWN) + r" (\S+=\S+ )*error=\S"
    )

    def warned() -> list[re.Match[str]]:
        return [m for m in map(line.match, _lines(p)) if m]

    try:
        wait_for(
            lambda: len({m["pid"] for m in warned()}) == 2,
            what=f"both gateway processes' pub/sub warning as text: {p.output()[-800:]}",
        )
    finally:
        _stopped(p)
    assert not any(line.startswith("{") for line in _lines(p))
    stamp = datetime.strptime(warned()[0]["ts"], "%Y-%m-%d %H:%M:%S.%f")
    now_there = datetime.now(timezone(TZ_OFFSET)).replace(tzinfo=None)
    assert abs(now_there - stamp) < CLOCK_SLACK


def test_log_level_after_the_command_beats_the_setting(tmp_path: Path) -> None:
    p = _genq(
        tmp_path,
        "gateway",
        "--workers",
        "2",
        "--port",
        str(free_port()),
        "--log-level",
        "warning",
        GENQ_REDIS_URL=_unreachable_redis(),
        GENQ_LOG_LEVEL="debug",
    )
    try:
        wait_for(
            lambda: len(_pids(_records(p), PUBSUB_DOWN)) == 2,
            what=f"both gateway processes' pub/sub warning: {p.output()[-800:]}",
        )
    finally:
        _stopped(p)
    # each process logs its uvicorn startup (info) before it first tries pub/sub
    assert {r["level"] for r in _records(p)} == {"warning"}


def test_launcher_children_log_json_at_the_level_given_to_the_launcher(tmp_path: Path) -> None:
    p = _genq(
        tmp_path,
        "worker",
        "--engine",
        "sim",
        "--gpus",
        "0",
        "--procs-per-gpu",
        "2",
        "--log-level",
        "info",
        GENQ_REDIS_URL=REDIS_URL,
        GENQ_KEY_PREFIX=test_prefix("logs"),
        GENQ_LOG_LEVEL="warning",
    )
    try:
        wait_for(
            lambda: len(_pids(_records(p), "worker started")) == 2,
            what=f"both launched workers' start at info: {p.output()[-800:]}",
        )
    finally:
        _stopped(p)
    assert p.proc.returncode == 0  # drained
    records = _records(p)
    started = [r for r in records if r["msg"] == "worker started"]
    assert p.proc.pid not in _pids(records, "worker started")
    assert sorted(r["worker_id"].rsplit("-", 1)[1] for r in started) == ["g0p0", "g0p1"]
    launched = [r for r in records if r["msg"] == "worker process started"]
    assert {r["process"] for r in launched} == {p.proc.pid}
    assert {r["pid"] for r in launched} == {r["process"] for r in started}


def _serve(tmp_path: Path, *args: str, **env: str) -> tuple[Proc, str]:
    port = free_port()
    p = _genq(
        tmp_path,
        "serve",
        "--port",
        str(port),
        "--step-ms",
        "1",
        *args,
        GENQ_REDIS_URL=REDIS_URL,
        GENQ_KEY_PREFIX=test_prefix("logs"),
        **env,
    )
    return p, f"http://127.0.0.1:{port}"


def _uvicorn_started(records: list[dict[str, Any]]) -> set[int]:
    return {
        r["process"]
        for r in records
        if r["logger"] == "uvicorn.error" and r["msg"] == "Application startup complete."
    }


def test_serve_in_one_process_logs_uvicorn_and_genq_lines_as_json(tmp_path: Path) -> None:
    p, url = _serve(tmp_path)
    try:
        wait_for(lambda: httpx.get(f"{url}/v1/models").json()["data"], what="genq serve")
        wait_for(
            lambda: _uvicorn_started(_records(p)) and _pids(_records(p), "worker started"),
            what=f"uvicorn's and the worker's start as JSON: {p.output()[-800:]}",
        )
    finally:
        _stopped(p)
    records = _records(p)
    assert _uvicorn_started(records) == _pids(records, "worker started") == {p.proc.pid}


def test_serve_with_worker_processes_logs_json_from_every_process(tmp_path: Path) -> None:
    p, _ = _serve(tmp_path, "--procs-per-gpu", "2", "--log-level", "info", GENQ_LOG_LEVEL="warning")
    try:
        wait_for(
            lambda: (
                _uvicorn_started(_records(p)) and len(_pids(_records(p), "worker started")) == 2
            ),
            what=f"uvicorn's and both workers' start as JSON: {p.output()[-800:]}",
        )
    finally:
        _stopped(p)
    records = _records(p)
    launcher = _pids(records, "worker process started")
    workers = _pids(records, "worker started")
    assert _uvicorn_started(records) == {p.proc.pid}
    assert len(launcher) == 1 and len(workers) == 2
    assert not ({p.proc.pid} & launcher) and not (({p.proc.pid} | launcher) & workers)
