"""Keepalive comments of a real gateway: one loop per process writes them straight to each idle
stream's connection (`gateway.keepalive`), framed as uvicorn frames a chunk, so a stream that
waits, then gets its events, reads as one well-formed response."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import httpx

from gateway.keepalive import KEEPALIVE, KeepaliveTicker
from tests.conftest import REDIS_URL
from tests.procs import quick_cluster

KEEPALIVE_S = 0.5


def test_an_idle_stream_gets_comments_then_its_events_in_one_response(tmp_path: Path) -> None:
    with quick_cluster(
        REDIS_URL, tmp_path, "keepalive", GENQ_SSE_KEEPALIVE_S=str(KEEPALIVE_S)
    ) as cluster:
        gateway = cluster.gateway()
        cluster.worker("--step-ms", "5")  # announces the model, then goes
        cluster.procs[-1].stop()
        body = {"model": "sim", "prompt": "hello", "max_tokens": 8, "stream": True}
        seen: list[str] = []
        comments_at: list[float] = []
        with httpx.stream("POST", f"{gateway.url}/v1/jobs", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith(":"):
                    comments_at.append(time.monotonic())
                    if len(comments_at) == 3:  # the job waited: now a worker takes it
                        cluster.worker("--step-ms", "5")
                elif line.startswith("event:"):
                    seen.append(line.removeprefix("event:").strip())
        assert len(comments_at) >= 3
        gaps = [b - a for a, b in itertools.pairwise(comments_at)]
        assert all(KEEPALIVE_S * 0.5 < g < KEEPALIVE_S * 3 for g in gaps[:2]), gaps
        assert seen[0] == "queued" and seen[-1] == "done" and "token" in seen


def test_the_loop_writes_only_to_streams_idle_for_the_interval() -> None:
    written: list[str] = []
    ticker = KeepaliveTicker(keepalive_s=10)
    idle = ticker.add(lambda chunk: written.append("idle") is None and chunk == KEEPALIVE)
    busy = ticker.add(lambda chunk: written.append("busy") is None)
    gone = ticker.add(lambda chunk: written.append("gone") is None)
    ticker.remove(gone)
    busy.last = idle.last + 9
    assert ticker.tick(idle.last + 10) == 1 and written == ["idle"]
    assert ticker.tick(idle.last + 5) == 0  # just written: not due again
    assert ticker.tick(busy.last + 10) == 1 and written == ["idle", "busy"]
    assert len(ticker) == 2
