"""`python -m genq.benchgpu --model sim`: the GPU benchmark's system path on the sim engine (its
harness, without a GPU): one result per level, each naming its engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL

pytestmark = pytest.mark.e2e
RUN_TIMEOUT_S = 90


def test_a_sweep_reports_every_level(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "genq.benchgpu", "--model", "sim", "--sweep", "1,3"]
    cmd += ["--new-tokens", "4", "--logs", str(tmp_path / "logs"), "--json-out", str(out)]
    env = {**os.environ, "GENQ_REDIS_URL": REDIS_URL}
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    results = json.loads(out.read_text())
    assert [(r["run"], r["streams"]) for r in results] == [("system", 1), ("system", 3)]
    assert all(r["engine"] == "sim" and r["tokens"] == r["jobs"] * 4 for r in results)
