"""`python -m genq.benchgpu --model sim`: the GPU benchmark's system path on the sim engine (its
harness, without a GPU): one result per level, each naming its engine; a run ended by SIGTERM
stops what it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from genq.benchgpu import TERMINATED
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.e2e
RUN_TIMEOUT_S = 90
STOP_TIMEOUT_S = 40
"""The processes get SIGTERM and their own shutdown grace before they are killed."""


def test_a_sweep_reports_every_level(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "genq.benchgpu", "--model", "sim", "--sweep", "1,3"]
    cmd += ["--new-tokens", "4", "--logs", str(tmp_path / "logs"), "--json-out", str(out)]
    env = {**os.environ, "GENQ_REDIS_URL": REDIS_URL}
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    results = json.loads(out.read_text())
    assert [(r["run"], r["streams"]) for r in results] == [("system sweep", 1), ("system sweep", 3)]
    assert all(r["engine"] == "sim" and r["tokens"] == r["jobs"] * 4 for r in results)


def test_a_run_ended_by_sigterm_stops_the_processes_it_started(tmp_path: Path) -> None:
    """`timeout` ends a benchmark with SIGTERM; a worker left running would hold the GPU."""
    cmd = [sys.executable, "-m", "genq.benchgpu", "--model", "sim", "--sweep", "2"]
    cmd += ["--new-tokens", "2000", "--requests-per-stream", "50", "--logs", str(tmp_path)]
    env = {**os.environ, "GENQ_REDIS_URL": REDIS_URL}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as bench:
        try:
            assert bench.stderr is not None
            for line in bench.stderr:  # the system is up and the level has begun
                if line.startswith(b"# starting"):
                    break
            children = psutil.Process(bench.pid).children(recursive=True)
            assert len(children) >= 2  # a gateway and a worker
            bench.terminate()
            assert bench.wait(RUN_TIMEOUT_S) == TERMINATED
            _, alive = psutil.wait_procs(children, timeout=STOP_TIMEOUT_S)
            assert alive == []
        finally:
            if bench.poll() is None:
                bench.kill()


def test_a_min_tokens_compare_runs_the_same_jobs_with_and_without_it(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "genq.benchgpu", "--model", "sim", "--min-tokens-compare", "2"]
    cmd += ["--new-tokens", "6", "--logs", str(tmp_path / "logs"), "--json-out", str(out)]
    env = {**os.environ, "GENQ_REDIS_URL": REDIS_URL}
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    rows = {r["run"]: r for r in json.loads(out.read_text())}
    plain, minimum = rows["system, plain"], rows["system, min_tokens"]
    assert minimum["tokens"] == minimum["jobs"] * 6  # every job ran to its max_tokens
    assert plain["jobs"] == minimum["jobs"] == 4
    ratio = rows["ratio min_tokens/plain"]
    assert ratio["tokens_per_s"] is not None and ratio["streams"] == 2
    assert "ratio min_tokens/plain, median of the rounds" in rows
