"""The test command leaves nothing in the developer's Redis (issue 13, item 23): a test run's
keys, those of the genq processes it started included (queues have no TTL), are all under
its session's prefix and removed when it ends."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from tests.conftest import REDIS_URL

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
RUN_S = 300
SAMPLE = [
    "tests/e2e/test_processes.py::test_stream_started_on_one_gateway_resumes_on_another",
    "tests/integration/test_jobs_api.py",
]
"""Real gateway and worker processes under a test's prefix, and the in-process stack."""


def test_a_test_run_leaves_no_key_behind() -> None:
    session = f"nokeys{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "GENQ_TEST_SESSION": session}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SAMPLE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        left = list(client.scan_iter(match=f"genqtest:{session}:*", count=1000))
    finally:
        client.close()
    assert left == []
