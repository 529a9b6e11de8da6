"""/dashboard/events from a real `genq gateway`: one SSE stream whose frames follow a job
from queued to its end, and which ends when the gateway shuts down (a stream that never
ends by itself must not hold a drain for its whole grace)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REDIS_URL
from tests.procs import Cluster, quick_cluster

pytestmark = pytest.mark.e2e
GRACE_S = 20
"""The gateway's shutdown grace: far longer than a drain with only a dashboard open takes."""
DRAINED_WITHIN_S = 5.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with quick_cluster(
        REDIS_URL,
        tmp_path,
        "dash",
        GENQ_SHUTDOWN_GRACE_S=str(GRACE_S),
        GENQ_DASHBOARD_INTERVAL_S="0.1",
    ) as c:
        yield c


def frames(response: httpx.Response) -> Iterator[dict[str, Any]]:
    buf = ""
    for chunk in response.iter_text():
        buf += chunk
        *done, buf = buf.split("\n\n")
        for frame in done:
            fields = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
            if fields.get("event") == "update":
                yield json.loads(fields["data"])


@pytest.mark.contract
def test_the_stream_follows_a_job_and_ends_with_the_gateway(cluster: Cluster) -> None:
    gateway = cluster.gateway()
    cluster.worker("--step-ms", "20")
    statuses: list[str] = []
    with httpx.stream("GET", f"{gateway.url}/dashboard/events", timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        updates = frames(r)
        first = next(updates)
        assert [w["model"] for w in first["workers"]["rows"].values()] == ["sim"]
        job = httpx.post(
            f"{gateway.url}/v1/jobs", json={"model": "sim", "prompt": "x", "max_tokens": 30}
        ).json()
        for frame in updates:
            row = frame.get("jobs", {}).get("rows", {}).get(job["id"])
            if row is not None and (not statuses or statuses[-1] != row["status"]):
                statuses.append(row["status"])
            if statuses and statuses[-1] == "succeeded":
                break
        assert statuses[-1] == "succeeded" and "running" in statuses, statuses

        gateway.signal(signal.SIGTERM)
        started = time.monotonic()
        for _ in updates:  # the stream ends: the iteration stops rather than timing out
            pass
    assert gateway.proc.wait(GRACE_S) == 0
    assert time.monotonic() - started < DRAINED_WITHIN_S
