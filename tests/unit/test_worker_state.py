"""What the worker keeps about a job leaves with the job, and a stop reaches only the attempt
it names: the engine runner tags outputs with their attempt."""

from __future__ import annotations

import asyncio

from shared.keys import Keys
from shared.schemas import JobSpec, Sampling
from shared.settings import Settings
from worker.engine import EngineJob, StepOutput, Stop
from worker.jobstate import Claim, RunningJob
from worker.lease import LeaseClock
from worker.runner import EngineRunner
from worker.sim import SimEngine
from worker.state import WorkerState

JOB = "a" * 32


def _state(engine: SimEngine) -> WorkerState:
    settings = Settings()
    return WorkerState(
        settings=settings,
        engine=engine,
        id="w",
        model="sim",
        keys=Keys(),
        redis=None,  # type: ignore[arg-type]  # nothing here touches Redis
        scripts=None,  # type: ignore[arg-type]
        transitions=None,  # type: ignore[arg-type]
        queues={},
        overflow={},
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


async def _outputs(runner: EngineRunner, until: int) -> list[StepOutput]:
    out: list[StepOutput] = []
    async with asyncio.timeout(5):
        while len(out) < until:
            out += runner.drain()
            await asyncio.sleep(0.005)
    return out


async def test_drop_stops_the_attempt_and_forgets_the_job() -> None:
    engine = SimEngine(step_ms=50)
    st = _state(engine)
    runner = st.runner = EngineRunner(engine, asyncio.get_running_loop(), lambda: None)
    runner.start()
    try:
        job = EngineJob(JOB, [5, 6], 100, Sampling(seed=1), 1)
        st.running[JOB] = _run(1)
        runner.add(job, 1)
        assert st.drop(JOB) is not None and JOB not in st.running and st.room.is_set()
        [confirm] = await _outputs(runner, 1)
        assert confirm.stopped == Stop("dropped") and confirm.attempt == 1
        assert st.drop(JOB) is None
    finally:
        runner.stop()


async def test_a_late_stop_of_an_old_attempt_never_touches_the_new_one() -> None:
    """A job handed back and claimed again by the same worker: the stop of attempt 1 lands
    after attempt 2 was added; only attempt 2's outputs carry its number."""
    engine = SimEngine(step_ms=20)
    runner = EngineRunner(engine, asyncio.get_running_loop(), lambda: None)
    runner.start()
    try:
        job = EngineJob(JOB, [5, 6], 3, Sampling(seed=1), 1)
        runner.add(job, 1)
        runner.cancel(JOB, 1, Stop("dropped"))
        runner.add(job, 2)
        runner.cancel(JOB, 1, Stop("cancelled", "stale"))  # names attempt 1: ignored
        out = await _outputs(runner, 4)  # attempt 1's stop, then attempt 2's three tokens
        assert [(o.attempt, o.stopped) for o in out if o.stopped] == [(1, Stop("dropped"))]
        second = [o for o in out if o.attempt == 2]
        assert len(second) == 3 and second[-1].finish_reason == "length"
        assert all(o.stopped is None for o in second)
    finally:
        runner.stop()


async def test_a_stop_is_sent_once() -> None:
    engine = SimEngine(step_ms=20)
    st = _state(engine)
    runner = st.runner = EngineRunner(engine, asyncio.get_running_loop(), lambda: None)
    runner.start()
    try:
        st.running[JOB] = run = _run(1)
        runner.add(EngineJob(JOB, [5, 6], 100, Sampling(seed=1), 1), 1)
        st.cancel(JOB, "client disconnected")
        st.stop(run, Stop("expired"))  # the first stop wins
        [confirm] = await _outputs(runner, 1)
        assert confirm.stopped == Stop("cancelled", "client disconnected")
        assert run.stop == Stop("cancelled", "client disconnected")
    finally:
        runner.stop()
