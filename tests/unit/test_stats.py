"""genq/stats.py (the benchmarks' figures) and genq/procstats.py (CPU time of real processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from genq import procstats
from genq.stats import TokenTimes, latency, ms, percentile
from tests.procs import wait_for


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 51.0  # rank round(0.5 * 99) = 50 (0-based)
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0 and percentile(values, 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([], 50) is None
    assert ms(0.0123456, 2) == 12.35 and ms(None, 2) is None


def test_an_events_gap_is_divided_among_its_tokens() -> None:
    t = TokenTimes(start=10.0)
    t.arrived(10.5, 2)  # first event: time to first token, no gap
    t.arrived(10.6, 1)
    t.arrived(11.0, 4)
    t.arrived(11.2, 0)  # an event without tokens changes nothing
    assert t.ttft == pytest.approx(0.5)
    assert t.tokens == 7
    assert t.gaps == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])


def test_recount_spreads_chunks_over_the_tokens_they_held() -> None:
    t = TokenTimes(start=0.0)
    for now in (1.0, 1.2, 1.4):  # three chunks, each counted as one token
        t.arrived(now, 1)
    t.recount(6)  # the usage chunk: 6 tokens, 2 per chunk on average
    assert t.tokens == 6 and t.gaps == pytest.approx([0.1, 0.1])
    empty = TokenTimes(start=0.0)
    empty.recount(5)
    assert empty.tokens == 0 and empty.gaps == []


def test_latency_summarises_every_stream() -> None:
    a, b = TokenTimes(start=0.0), TokenTimes(start=0.0)
    a.arrived(0.010, 1)
    a.arrived(0.012, 1)
    b.arrived(0.030, 1)
    b.arrived(0.034, 1)
    silent = TokenTimes(start=0.0)
    assert latency([a, b, silent], 1) == {
        "ttft_ms_p50": 10.0,  # rank round(0.5) = 0 of two
        "ttft_ms_p99": 30.0,
        "itl_ms_p50": 2.0,
        "itl_ms_p99": 4.0,
    }
    assert latency([], 1) == dict.fromkeys(
        ["ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"]
    )


# ---- procstats, on real processes --------------------------------------------------------------

_BUSY_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("busy", flush=True)
time.sleep(60)
"""


def test_process_tree_and_cpu_seconds_of_real_processes() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _BUSY_PARENT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "busy"
        wait_for(lambda: procstats.process_tree(parent.pid) == [parent.pid, child])
        assert procstats.children(parent.pid) == [child]
        assert procstats.cpu_seconds(parent.pid) >= 0.3
        assert procstats.cpu_seconds(child) < 0.3  # its own time, not its children's
        total = procstats.total_cpu_seconds([parent.pid, child])
        assert total >= procstats.cpu_seconds(parent.pid)
        name = psutil.Process(parent.pid).name()
        assert parent.pid in procstats.pids_named(name)
    finally:
        for pid in procstats.process_tree(parent.pid)[::-1]:
            os.kill(pid, 9)
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    gone = parent.pid
    assert procstats.process_tree(gone) == []
    assert procstats.total_cpu_seconds([gone]) == 0.0
    with pytest.raises(psutil.NoSuchProcess):
        procstats.cpu_seconds(gone)
