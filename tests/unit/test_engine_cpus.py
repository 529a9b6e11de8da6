"""GENQ_ENGINE_CPUS: the engine process runs on the CPUs it names, while its worker keeps its
own; unset, the engine process runs where its worker does."""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest

from shared.settings import Settings
from worker.engine_client import EngineProcess

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux CPU affinity and two CPUs",
)


async def _engine_affinity(settings: Settings) -> list[int]:
    link = await EngineProcess.spawn(settings)
    try:
        link.start(asyncio.get_running_loop(), lambda: None)
        assert link.pid is not None
        return sorted(psutil.Process(link.pid).cpu_affinity())
    finally:
        await link.aclose()


async def test_the_engine_process_runs_on_the_cpus_named() -> None:
    mine = sorted(os.sched_getaffinity(0))
    last = mine[-1]
    assert await _engine_affinity(Settings(engine_cpus=str(last))) == [last]
    assert sorted(os.sched_getaffinity(0)) == mine  # the worker's own set is left as it was


async def test_unset_the_engine_process_runs_where_its_worker_does() -> None:
    assert await _engine_affinity(Settings()) == sorted(os.sched_getaffinity(0))


def test_a_cpu_list_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="engine_cpus"):
        Settings(engine_cpus="all")
