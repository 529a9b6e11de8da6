"""What the worker keeps about a job leaves with the job, and a stop reaches only the attempt
it names: outputs are tagged with their attempt, on a thread of the worker and across the
engine process's boundary alike (each test runs with both)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from shared.keys import Keys
from shared.schemas import JobSpec, Sampling
from shared.settings import Settings
from worker.cachemodel import CacheModel
from worker.engine import EngineJob, StepOutput, Stop
from worker.engine_client import EngineProcess
from worker.jobstate import Claim, RunningJob
from worker.lease import LeaseClock
from worker.link import EngineLink
from worker.runner import EngineRunner
from worker.sim import SimEngine
from worker.state import WorkerState

JOB = "a" * 32
AFTER_STOP_S = 0.2
"""Time for a second stop confirmation to show, were one sent (the sims step every 20–50 ms)."""
MakeLink = Callable[[float], Awaitable[EngineLink]]


@pytest.fixture(params=["thread", "process"])
async def make_link(request: pytest.FixtureRequest) -> AsyncIterator[MakeLink]:
    """A started link to a sim engine stepping every `step_ms`: on a thread, or in an engine
    process of its own."""
    links: list[EngineLink] = []

    async def make(step_ms: float) -> EngineLink:
        link: EngineLink
        if request.param == "thread":
            link = EngineRunner(SimEngine(step_ms=step_ms))
        else:
            link = await EngineProcess.spawn(Settings(sim_step_ms=step_ms))
        link.start(asyncio.get_running_loop(), lambda: None)
        links.append(link)
        return link

    yield make
    for link in links:
        await link.aclose()


def _state(link: EngineLink) -> WorkerState:
    settings = Settings()
    return WorkerState(
        settings=settings,
        engine=link,
        id="w",
        model="sim",
        keys=Keys(),
        redis=None,  # type: ignore[arg-type]  # nothing here touches Redis
        scripts=None,  # type: ignore[arg-type]
        transitions=None,  # type: ignore[arg-type]
        queues={},
        overflow={},
        placed={},
        cache=CacheModel(16),
        lease=LeaseClock(settings.lease_s),
    )


def _run(attempt: int) -> RunningJob:
    spec = JobSpec(
        id=JOB,
        model="sim",
        input_ids=[1],
        max_tokens=2,
        sampling=Sampling(),
        priority="interactive",
        created_at=0.0,
    )
    return RunningJob(
        spec=spec, claim=Claim("1-0", "q", JOB, 3), attempt=attempt, seq=1, started_wall=0.0
    )


async def _stopped(link: EngineLink) -> list[StepOutput]:
    """The engine's stop confirmations, once the first is in and a few steps more have passed
    (a token the engine made before the stop reached it may come first: it is not counted)."""
    stops = [o for o in await _outputs(link, 1, stopped=True) if o.stopped is not None]
    await asyncio.sleep(AFTER_STOP_S)
    return stops + [o for o in link.drain() if o.stopped is not None]


async def _outputs(link: EngineLink, until: int, stopped: bool = False) -> list[StepOutput]:
    out: list[StepOutput] = []
    async with asyncio.timeout(5):
        while len([o for o in out if o.stopped is not None or not stopped]) < until:
            out += link.drain()
            await asyncio.sleep(0.005)
    return out


async def test_drop_stops_the_attempt_and_forgets_the_job(make_link: MakeLink) -> None:
    st = _state(await make_link(50))
    job = EngineJob(JOB, [5, 6], 100, Sampling(seed=1), 1)
    st.running[JOB] = _run(1)
    st.runner.add(job, 1)
    assert st.drop(JOB) is not None and JOB not in st.running and st.room.is_set()
    [confirm] = await _stopped(st.runner)
    assert confirm.stopped == Stop("dropped") and confirm.attempt == 1
    assert st.drop(JOB) is None


async def test_a_late_stop_of_an_old_attempt_never_touches_the_new_one(
    make_link: MakeLink,
) -> None:
    """A job handed back and claimed again by the same worker: the stop of attempt 1 lands
    after attempt 2 was added; only attempt 2's outputs carry its number."""
    link = await make_link(20)
    job = EngineJob(JOB, [5, 6], 3, Sampling(seed=1), 1)
    link.add(job, 1)
    link.cancel(JOB, 1, Stop("dropped"))
    link.add(job, 2)
    link.cancel(JOB, 1, Stop("cancelled", "stale"))  # names attempt 1: ignored
    out: list[StepOutput] = []
    async with asyncio.timeout(5):  # until attempt 2 has ended
        while not any(o.attempt == 2 and o.finish_reason for o in out):
            out += link.drain()
            await asyncio.sleep(0.005)
    assert [(o.attempt, o.stopped) for o in out if o.stopped] == [(1, Stop("dropped"))]
    second = [o for o in out if o.attempt == 2]
    assert len(second) == 3 and second[-1].finish_reason == "length"
    assert all(o.stopped is None for o in second)
    # attempt 1 may have made a token before its stop reached the engine (the commands can
    # arrive in separate reads), never after it
    first = [o for o in out if o.attempt == 1]
    assert first[-1].stopped == Stop("dropped") and all(o.token_ids for o in first[:-1])


async def test_a_stop_is_sent_once(make_link: MakeLink) -> None:
    st = _state(await make_link(20))
    st.running[JOB] = run = _run(1)
    st.runner.add(EngineJob(JOB, [5, 6], 100, Sampling(seed=1), 1), 1)
    st.cancel(JOB, "client disconnected")
    st.stop(run, Stop("expired"))  # the first stop wins
    [confirm] = await _stopped(st.runner)
    assert confirm.stopped == Stop("cancelled", "client disconnected")
    assert run.stop == Stop("cancelled", "client disconnected")
