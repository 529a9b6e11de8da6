"""The engine core's doorstep: adds past their limit wait there, in order, and join the engine
before the step after the one that freed their slots; cancelled there as in the engine; and
counted as applied (for the worker's page promises) in the order they were sent."""

from __future__ import annotations

from shared.schemas import Sampling
from worker.core import AddCommand, CancelCommand, EngineCore
from worker.engine import EngineJob, Stop
from worker.sim import SimEngine

PROMPT = [5, 6, 7]


def _add(job_id: str, max_tokens: int = 2, limit: int = 0, attempt: int = 1) -> AddCommand:
    return AddCommand(EngineJob(job_id, PROMPT, max_tokens, Sampling(), 1), attempt, limit)


def _core(max_batch: int = 4) -> tuple[EngineCore, SimEngine]:
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0, max_batch=max_batch)
    return EngineCore(engine), engine


def test_an_add_past_its_limit_waits_and_joins_before_the_next_step() -> None:
    core, engine = _core()
    assert core.apply([_add("a", limit=2), _add("b", limit=2), _add("c", limit=2)]) == []
    assert engine.active() == 2 and core.waiting() == 1  # c is at the doorstep
    core.step()
    ended = core.step()  # a and b make their second (last) token
    assert {o.job_id for o in ended if o.finish_reason} == {"a", "b"}
    core.apply([])  # the engine process's next turn, before its next step
    assert engine.active() == 1 and core.waiting() == 0
    [out] = core.step()
    assert out.job_id == "c" and out.attempt == 1 and out.token_ids


def test_a_waiting_add_is_cancelled_as_a_running_job_is() -> None:
    core, engine = _core(max_batch=1)
    core.apply([_add("a"), _add("b")])
    stop = Stop("cancelled", "by the client")
    [out] = core.apply([CancelCommand("b", 1, stop)])
    assert out.job_id == "b" and out.stopped == stop and out.attempt == 1
    assert core.waiting() == 0
    core.step()
    core.step()
    core.apply([])
    assert engine.active() == 0  # b never joined
    assert core.apply([CancelCommand("b", 1, stop)]) == []  # nothing left to cancel


def test_a_cancel_of_another_attempt_leaves_the_waiting_add() -> None:
    core, _ = _core(max_batch=1)
    core.apply([_add("a"), _add("b", attempt=2)])
    assert core.apply([CancelCommand("b", 1, Stop("cancelled"))]) == []
    assert core.waiting() == 1


def test_a_higher_limit_passes_waiting_adds_and_adds_count_in_order() -> None:
    core, engine = _core(max_batch=4)
    core.apply([_add("a", limit=2), _add("b", limit=2)])
    assert core.adds == 2
    core.apply([_add("batch", limit=2), _add("interactive")])  # adds 3 and 4
    assert engine.active() == 3 and core.waiting() == 1  # the interactive one joined
    # add 4 is applied but add 3 is not: the worker's promise for add 3 must stand
    assert core.adds == 2
    core.step()
    core.step()
    core.apply([])
    assert core.waiting() == 0 and core.adds == 4


def test_a_new_attempt_replaces_its_jobs_waiting_one() -> None:
    core, _ = _core(max_batch=1)
    core.apply([_add("a"), _add("b"), _add("b", attempt=2)])
    assert core.waiting() == 1
    core.step()
    core.step()
    core.apply([])
    [out] = core.step()
    assert out.job_id == "b" and out.attempt == 2
