"""Redis Sentinel: SIGKILL the master under 200 queued and 50 streaming jobs. The sentinels
promote the replica; the gateway and the workers follow it; with WAIT (the default with
sentinels) every job a client was told was accepted completes, and every stream ends
exactly right (issue 16)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.sentinel_scenario import failover
from tests.chaos.sentinels import SentinelGroup, sentinel_binary, sentinel_group

QUEUED = 200
STREAMS = 50
STALL_MS = 150
"""The replica is cut off this long before the master dies: writes the master acknowledges
meanwhile are on the master only, the window asynchronous replication leaves."""
WAIT_TIMEOUT_MS = 500
"""Longer than the stall, so WAIT outlasts it (GENQ_REDIS_WAIT_TIMEOUT_MS)."""


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    if sentinel_binary() is None:
        pytest.skip("needs redis-sentinel (Debian's redis-sentinel package) or redis-server")
    with sentinel_group() as g:
        yield g


@pytest.mark.contract
async def test_a_master_killed_under_load_loses_no_accepted_job(
    group: SentinelGroup, tmp_path: Path
) -> None:
    r = await failover(
        group,
        tmp_path,
        wait_replicas=1,
        queued=QUEUED,
        streams=STREAMS,
        stall_ms=STALL_MS,
        wait_timeout_ms=WAIT_TIMEOUT_MS,
    )
    print(r)
    assert r.accepted == QUEUED
    assert r.lost == [], f"{len(r.lost)} accepted jobs lost with WAIT"
    assert r.stuck == [], f"{len(r.stuck)} jobs never ended"
    assert r.completed == QUEUED
    assert r.stream_faults == {}
    assert r.streams_across_kill >= STREAMS // 2, "the streams ended before the kill"
    assert r.submit_recovery_s is not None and r.stream_recovery_s is not None


async def test_without_wait_a_lagging_replica_loses_acknowledged_jobs(
    group: SentinelGroup, tmp_path: Path
) -> None:
    """The control: the same failover without WAIT loses jobs clients were told were
    accepted (what the test above shows WAIT prevents), and no job that survived sticks."""
    r = await failover(
        group, tmp_path, wait_replicas=0, queued=QUEUED, streams=STREAMS, stall_ms=STALL_MS
    )
    print(r)
    assert r.accepted == QUEUED
    assert r.lost, "nothing lost: the stall did not open the replication window"
    assert r.stuck == [], f"{len(r.stuck)} jobs never ended"
    assert r.completed == QUEUED - len(r.lost)
