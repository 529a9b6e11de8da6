"""End to end with real processes: `genq gateway` ×2 and `genq worker` over real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import REDIS_URL, parse_sse
from tests.procs import Cluster, free_port, quick_cluster, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with quick_cluster(REDIS_URL, tmp_path, "e2e") as c:
        yield c


def _status(url: str, job_id: str) -> str:
    return str(httpx.get(f"{url}/v1/jobs/{job_id}").json()["status"])


def _post(url: str, **body: object) -> httpx.Response:
    body.setdefault("model", "sim")
    return httpx.post(f"{url}/v1/jobs", json=body, timeout=10)


@pytest.mark.contract
def test_stream_started_on_one_gateway_resumes_on_another(cluster: Cluster) -> None:
    a, b = cluster.gateway(), cluster.gateway()
    cluster.worker("--step-ms", "20")
    seen: list[tuple[int, str, dict]] = []
    with httpx.stream(
        "POST",
        f"{a.url}/v1/jobs",
        json={"model": "sim", "prompt": "hi", "max_tokens": 60, "seed": 5, "stream": True},
        timeout=10,
    ) as r:
        job_id = r.headers["x-job-id"]
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            *frames, buf = buf.split("\n\n")
            seen += parse_sse("\n\n".join(frames) + "\n\n") if frames else []
            if sum(1 for e in seen if e[1] == "token") >= 10:
                break  # the client drops gateway A mid-stream
    last = seen[-1][0]
    r = httpx.get(
        f"{b.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(last)}, timeout=20
    )
    rest = parse_sse(r.text)
    events = seen + rest
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert events[-1][1] == "done"
    text = "".join(e[2]["text"] for e in events if e[1] == "token")
    job = httpx.get(f"{b.url}/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["text"] == text
    assert job["usage"]["completion_tokens"] == 60


def test_cancel_frees_the_slot_within_a_second(cluster: Cluster) -> None:
    gw = cluster.gateway()
    cluster.worker("--step-ms", "50", "--max-batch", "1")
    running = _post(gw.url, prompt="long", max_tokens=2000).json()["id"]
    wait_for(lambda: _status(gw.url, running) == "running", what="job running")
    queued = _post(gw.url, prompt="queued", max_tokens=2000).json()["id"]
    third = _post(gw.url, prompt="third", max_tokens=5).json()["id"]

    t0 = time.monotonic()
    assert httpx.delete(f"{gw.url}/v1/jobs/{queued}").json()["status"] == "cancelled"
    assert time.monotonic() - t0 < 1.0

    t0 = time.monotonic()
    assert httpx.delete(f"{gw.url}/v1/jobs/{running}").status_code == 200
    wait_for(
        lambda: _status(gw.url, third) in ("running", "succeeded"),
        timeout=1.0,
        interval=0.01,
        what="the freed slot taken by the next job",
    )
    assert time.monotonic() - t0 < 1.0
    assert _status(gw.url, running) == "cancelled"
    assert httpx.get(f"{gw.url}/v1/jobs/{queued}").json()["attempt"] == 0  # never ran


@pytest.mark.contract
def test_disconnecting_stream_with_cancel_on_disconnect_cancels(cluster: Cluster) -> None:
    gw = cluster.gateway()
    cluster.worker("--step-ms", "50")
    body = {
        "model": "sim",
        "prompt": "x",
        "max_tokens": 2000,
        "stream": True,
        "cancel_on_disconnect": True,
    }
    with httpx.stream("POST", f"{gw.url}/v1/jobs", json=body, timeout=10) as r:
        job_id = r.headers["x-job-id"]
        for line in r.iter_lines():
            if line == "event: token":
                break
    t0 = time.monotonic()
    wait_for(
        lambda: _status(gw.url, job_id) == "cancelled",
        timeout=1.0,
        interval=0.01,
        what="cancel after disconnect",
    )
    assert time.monotonic() - t0 < 1.0


def test_idempotency_key_across_gateways(cluster: Cluster) -> None:
    a, b = cluster.gateway(), cluster.gateway()
    cluster.worker("--step-ms", "1")
    body = {"model": "sim", "prompt": "pay once", "max_tokens": 3}
    h = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    first = httpx.post(f"{a.url}/v1/jobs", json=body, headers=h)
    second = httpx.post(f"{b.url}/v1/jobs", json=body, headers=h)
    assert first.status_code == 202 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    clash = httpx.post(f"{b.url}/v1/jobs", json={**body, "max_tokens": 4}, headers=h)
    assert clash.status_code == 422


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"null",
        b"[]",
        b'{"model": 5, "prompt": "x"}',
        b'{"model": "sim", "prompt": "x", "max_tokens": "many"}',
        b'{"model": "sim", "prompt": "x", "max_tokens": 1e99}',
        b'{"model": "sim", "input_ids": []}',
        b'{"model": "sim", "input_ids": [-1]}',
        b'{"model": "sim", "prompt": "x", "seed": 99999999999999999999999}',
        b'{"model": "sim", "prompt": "x", "timeout_s": -1}',
        b'{"model": "sim", "prompt": "x", "stream": "yes please"}',
        b"\xff\xfe garbage",
    ],
)
def test_malformed_bodies_get_4xx_never_5xx(cluster: Cluster, raw: bytes) -> None:
    if not cluster.procs:
        cluster.gateway()
        cluster.worker("--step-ms", "1")
    gw = cluster.procs[0]
    r = httpx.post(f"{gw.url}/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]


def test_genq_serve_runs_on_its_embedded_defaults(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    env["GENQ_SIM_STEP_MS"] = "2"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "genq", "serve", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{url}/v1/models").json()["data"], what="genq serve")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "genq",
                "submit",
                "hello",
                "--url",
                url,
                "--max-tokens",
                "8",
                "--stream",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        assert len(out.stdout.split()) == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "started private redis-server" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_bench_prints_its_figures(cluster: Cluster) -> None:
    gw = cluster.gateway()
    cluster.worker("--step-ms", "1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "genq",
            "bench",
            "--url",
            gw.url,
            "--concurrency",
            "8",
            "--requests",
            "16",
            "--max-tokens",
            "20",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["completed"] == 16 and figures["errors"] == 0
    assert figures["tokens"] == 16 * 20
    assert figures["tokens_per_s"] > 0 and figures["ttft_ms_p50"] > 0
