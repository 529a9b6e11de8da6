"""A batch input file streams to storage: a real gateway checks and stores a 30 MB upload
holding much less than one copy of it in memory (issue 14: "never several copies of the whole
file in memory")."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import REDIS_URL
from tests.procs import Cluster, quick_cluster

pytestmark = pytest.mark.e2e

LINES = 20_000
PROMPT_CHARS = 1_500
MiB = 1 << 20
UPLOAD_S = 120.0
SAMPLE_S = 0.02
MAX_SHARE = 0.5
"""The gateway's memory may grow by at most this share of the file while it takes it."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with quick_cluster(REDIS_URL, tmp_path, "upload") as c:
        yield c


def _file() -> bytes:
    rng = random.Random(7)
    words = [f"w{rng.randrange(5000)}" for _ in range(PROMPT_CHARS // 4)]
    lines = []
    for i in range(LINES):
        rng.shuffle(words)
        prompt = " ".join(words)[:PROMPT_CHARS]
        body = {"model": "sim", "prompt": prompt, "max_tokens": 4}
        lines.append(
            json.dumps(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            )
        )
    return ("\n".join(lines) + "\n").encode()


def test_a_large_upload_costs_the_gateway_less_than_a_copy_of_it(cluster: Cluster) -> None:
    gateway = cluster.gateway()
    cluster.worker("--step-ms", "0")  # its model card: lines are checked against it
    data = _file()
    proc = psutil.Process(gateway.proc.pid)
    baseline = peak = proc.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        r = httpx.post(
            f"{gateway.url}/v1/files",
            files={"file": ("big.jsonl", data)},
            data={"purpose": "batch"},
            timeout=UPLOAD_S,
        )
    finally:
        done.set()
        sampler.join()
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == len(data)
    growth = peak - baseline
    size, base = len(data) / MiB, baseline / MiB
    print(f"{size:.1f} MiB file: gateway RSS {base:.0f} MiB, +{growth / MiB:.1f} MiB")
    assert growth < MAX_SHARE * len(data)
