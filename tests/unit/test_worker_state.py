"""What the worker keeps about a job is dropped with the job."""

from __future__ import annotations

from shared.keys import Keys
from shared.schemas import JobSpec, Sampling
from shared.settings import Settings
from worker.jobstate import Claim, RunningJob
from worker.lease import LeaseClock
from worker.sim import SimEngine
from worker.state import WorkerState


def _state() -> WorkerState:
    settings = Settings()
    return WorkerState(
        settings=settings,
        engine=SimEngine(step_ms=0),
        id="w",
        model="sim",
        keys=Keys(),
        redis=None,  # type: ignore[arg-type]  # nothing here touches Redis
        scripts=None,  # type: ignore[arg-type]
        transitions=None,  # type: ignore[arg-type]
        queues={},
        lease=LeaseClock(settings.lease_s),
    )


def test_forget_drops_the_job_and_its_notes() -> None:
    st = _state()
    spec = JobSpec(
        id="j",
        model="sim",
        input_ids=[1],
        max_tokens=2,
        sampling=Sampling(),
        priority="interactive",
        created_at=0.0,
    )
    st.running["j"] = RunningJob(
        spec=spec, claim=Claim("1-0", "q", "j", 3), attempt=1, seq=1, started_wall=0.0
    )
    st.cancel_reason["j"] = "client disconnected"
    st.expiring.add("j")
    assert st.forget("j") is not None
    assert "j" not in st.running and "j" not in st.cancel_reason and "j" not in st.expiring
    assert st.forget("j") is None
