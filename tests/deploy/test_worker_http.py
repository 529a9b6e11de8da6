"""The worker's HTTP server (GENQ_METRICS_PORT): /healthz while the process runs, /readyz only
while the worker can take jobs; real `genq worker` processes, a real redis-server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import REDIS_URL, test_prefix
from tests.procs import Cluster, Proc, RedisServer, free_port, wait_for

pytestmark = pytest.mark.e2e
HEALTHCHECK = Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py"
LEASE_S = 1.0
EXIT_TIMEOUT_S = 20.0


@pytest.fixture
def prefix() -> Iterator[str]:
    p = test_prefix()
    yield p
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    for key in r.scan_iter(match=f"{p}*", count=1000):
        r.delete(key)
    r.close()


def _get(port: int, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=3)


def _ready(port: int) -> bool:
    return _get(port, "/readyz").status_code == 200


def _not_ready(port: int) -> str | None:
    """The reason /readyz gives, or None while it answers 200."""
    r = _get(port, "/readyz")
    if r.status_code == 200:
        return None
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "not_ready" and body["reason"]
    return str(body["reason"])


def _worker(cluster: Cluster, port: int, **env: str) -> Proc:
    settings = {
        "GENQ_METRICS_PORT": str(port),
        "GENQ_LEASE_S": str(LEASE_S),
        "GENQ_HEARTBEAT_S": "0.2",
        **env,
    }
    p = cluster.worker(wait_model=None, **settings)
    wait_for(
        lambda: _get(port, "/healthz").status_code == 200,
        what=f"worker HTTP server: {p.output()[-500:] if p.log.exists() else ''}",
    )
    return p


def _healthcheck(*args: str, **env: str) -> int:
    run = subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args],
        env={**os.environ, **env},
        capture_output=True,
        timeout=10,
    )
    return run.returncode


def test_ready_only_while_its_heartbeat_and_card_are_in_redis(tmp_path: Path, prefix: str) -> None:
    server = RedisServer(tmp_path)  # not started yet: the worker comes up before Redis
    cluster = Cluster(server.url, tmp_path, prefix)
    port = free_port()
    try:
        w = _worker(cluster, port)
        assert _get(port, "/healthz").json() == {"status": "ok"}
        assert _not_ready(port) is not None
        # the container HEALTHCHECK: alive on /healthz, and a 503 counts as a failure
        assert _healthcheck(GENQ_METRICS_PORT=str(port)) == 0
        assert _healthcheck(f"http://127.0.0.1:{port}/readyz") == 1

        server.start()
        wait_for(lambda: _ready(port), what="ready once Redis answers")
        body = _get(port, "/readyz").json()
        assert body["model"] == "sim" and body["worker_id"]
        r = redis.Redis.from_url(server.url, decode_responses=True)
        assert r.exists(f"{prefix}worker:{body['worker_id']}") and r.exists(f"{prefix}model:sim")
        r.close()

        server.kill()
        wait_for(lambda: _not_ready(port) is not None, timeout=LEASE_S + 10, what="unready")
        assert _get(port, "/healthz").status_code == 200  # alive all the same: no restart

        server.start()  # same data (AOF): the worker beats again
        wait_for(lambda: _ready(port), what="ready again")
        assert w.proc.poll() is None
    finally:
        cluster.close()
        server.kill()
    assert _healthcheck(f"http://127.0.0.1:{port}/healthz") == 1  # nobody listens now


def test_a_draining_worker_is_not_ready_and_exits_zero(tmp_path: Path, prefix: str) -> None:
    cluster = Cluster(REDIS_URL, tmp_path, prefix)
    port = free_port()
    try:
        gw = cluster.gateway()
        w = _worker(cluster, port, GENQ_SIM_STEP_MS="50", GENQ_SHUTDOWN_GRACE_S="3")
        wait_for(lambda: _ready(port), what="ready")
        job = httpx.post(
            f"{gw.url}/v1/jobs", json={"model": "sim", "prompt": "hi", "max_tokens": 2000}
        ).json()
        wait_for(
            lambda: httpx.get(f"{gw.url}/v1/jobs/{job['id']}").json()["status"] == "running",
            what="job running",
        )
        w.signal(signal.SIGTERM)
        # at once, while the job still runs within its grace
        wait_for(lambda: _not_ready(port) == "draining", timeout=2, what="draining")
        assert _get(port, "/healthz").status_code == 200
        assert w.proc.wait(EXIT_TIMEOUT_S) == 0
        # handed back: queued again for another worker, not lost
        assert httpx.get(f"{gw.url}/v1/jobs/{job['id']}").json()["status"] == "queued"
    finally:
        cluster.close()


def test_the_port_in_use_stops_the_worker_with_a_clear_error(tmp_path: Path, prefix: str) -> None:
    cluster = Cluster(REDIS_URL, tmp_path, prefix)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            w = cluster.worker(wait_model=None, GENQ_METRICS_PORT=str(port))
            assert w.proc.wait(EXIT_TIMEOUT_S) != 0
            assert f"cannot listen on port {port}" in w.output()
        finally:
            cluster.close()
