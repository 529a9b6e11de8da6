"""Metrics with real processes: `genq gateway --workers 2` exports one view whichever process
a scrape reaches (prometheus-client's multiprocess mode), worker processes serve /metrics
on their own ports with `worker` and `gpu` labels, and the fleet's gauges move to another
gateway when their exporter is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REDIS_URL
from tests.procs import Cluster, free_port, quick_cluster, wait_for

pytestmark = pytest.mark.e2e

FLEET_INTERVAL_S = 0.2
FLEET_LEASE_S = 1.5
SCRAPES = 8
"""Scrapes, each on a new connection: with two processes, both answer some of them."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with quick_cluster(
        REDIS_URL,
        tmp_path,
        "e2e",
        GENQ_METRICS_FLEET_INTERVAL_S=str(FLEET_INTERVAL_S),
        GENQ_METRICS_FLEET_LEASE_S=str(FLEET_LEASE_S),
        GENQ_QUEUE_MODELS='["sim"]',
    ) as c:
        yield c


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text  # a new connection each time
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def one(found: dict, name: str, **labels: str) -> float | None:  # type: ignore[type-arg]
    hits = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]
    return sum(hits) if hits else None


def test_two_gateway_processes_export_one_view(cluster: Cluster) -> None:
    gw = cluster.gateway(processes=2)
    cluster.worker("--step-ms", "20")
    served: dict[int, int] = {}
    while len(served) < 2:  # until both processes have answered some
        with httpx.Client(base_url=gw.url, timeout=5) as c:  # one connection: one process
            pid = c.get("/readyz").json()["pid"]
            assert c.get("/health").status_code == 200
            served[pid] = served.get(pid, 0) + 1
        assert sum(served.values()) < 200, "one process answered every request"
    health = {"route": "/health", "method": "GET", "status": "200"}
    wait_for(lambda: one(scrape(gw.url), "genq_queue_length", priority="batch") == 0)
    for _ in range(SCRAPES):  # every process counts what both served, and shows the fleet
        found = scrape(gw.url)
        assert one(found, "genq_http_responses_total", **health) == sum(served.values())
        assert one(found, "genq_queue_lag", model="sim", priority="interactive") == 0
    # each process's memory, CPU and open files, whichever process answers the scrape
    for _ in range(SCRAPES):
        found = scrape(gw.url)
        for name in ("process_resident_memory_bytes", "process_cpu_seconds_total"):
            for pid in served:
                assert (one(found, name, pid=str(pid)) or 0) > 0, (name, pid)
        assert all((one(found, "process_open_fds", pid=str(pid)) or 0) > 0 for pid in served)

    # a stream open while scraping, then its client leaves
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/jobs",
        json={"model": "sim", "prompt": "long", "max_tokens": 5000, "stream": True},
        timeout=10,
    ) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # kept: a dropped iterator closes the response
        next(chunks)
        for _ in range(SCRAPES):
            assert one(scrape(gw.url), "genq_sse_streams_open") == 1
    wait_for(lambda: one(scrape(gw.url), "genq_client_disconnects_total", route="/v1/jobs") == 1)
    assert one(scrape(gw.url), "genq_sse_streams_open") == 0


def test_worker_processes_serve_their_metrics_with_worker_and_gpu_labels(
    cluster: Cluster,
) -> None:
    gw = cluster.gateway()
    base = free_port()
    cluster.worker("--gpus", "0,1", "--step-ms", "5", GENQ_METRICS_PORT=str(base))
    wait_for(lambda: len(httpx.get(f"{gw.url}/v1/models").json()["data"]) == 1)
    jobs = [
        httpx.post(f"{gw.url}/v1/jobs", json={"model": "sim", "prompt": f"p{i}", "max_tokens": 9})
        for i in range(6)
    ]
    ids = [j.json()["id"] for j in jobs]
    wait_for(
        lambda: all(httpx.get(f"{gw.url}/v1/jobs/{i}").json()["status"] == "succeeded" for i in ids)
    )
    ports = [base, base + 1]  # the launcher gives its Nth process port + N
    tokens = 0.0
    gpus = set()

    def counted() -> bool:
        return sum(
            one(scrape(f"http://127.0.0.1:{p}"), "genq_request_success_total") or 0 for p in ports
        ) == len(ids)

    wait_for(counted)
    for port in ports:
        found = scrape(f"http://127.0.0.1:{port}")
        labels = {dict(ls)["gpu"] for (n, ls) in found if n == "genq_generation_tokens_total"}
        workers = {dict(ls)["worker"] for (n, ls) in found if n == "genq_attempts_total"}
        assert len(labels) == 1 and len(workers) == 1
        gpus |= labels
        tokens += one(found, "genq_generation_tokens_total") or 0
    assert gpus == {"0", "1"}
    assert tokens == 9 * len(ids)  # every job's usage, counted by the worker that ran it


def test_the_fleet_exporter_killed_another_gateway_takes_over(cluster: Cluster) -> None:
    a, b = cluster.gateway(), cluster.gateway()

    def exporters() -> list[bool]:
        return [one(scrape(g.url), "genq_dead_letters") is not None for g in (a, b)]

    wait_for(lambda: any(exporters()))
    assert exporters().count(True) == 1
    holder, other = (a, b) if exporters()[0] else (b, a)
    holder.signal(signal.SIGKILL)  # it frees nothing: the lease must run out
    killed = time.monotonic()
    wait_for(lambda: one(scrape(other.url), "genq_dead_letters") is not None, timeout=20)
    assert time.monotonic() - killed <= FLEET_LEASE_S + 5 * FLEET_INTERVAL_S + 5


def test_genq_serve_answers_with_its_workers_metrics_too(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, "GENQ_SIM_STEP_MS": "2"},
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{url}/v1/models").json()["data"], what="genq serve")
        job = httpx.post(f"{url}/v1/jobs", json={"model": "sim", "prompt": "hi", "max_tokens": 7})
        wait_for(lambda: one(scrape(url), "genq_request_success_total") == 1)
        found = scrape(url)
        assert one(found, "genq_generation_tokens_total") == 7
        posted = {"route": "/v1/jobs", "method": "POST", "status": str(job.status_code)}
        assert one(found, "genq_http_responses_total", **posted) == 1
    finally:
        proc.send_signal(signal.SIGTERM)  # it stops the redis-server it started
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
