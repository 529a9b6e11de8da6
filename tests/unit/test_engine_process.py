"""The engine process's outbox: a step's outputs go out at once, unless steps come quicker
than COALESCE_S — then they share one message, never held past it, and never left behind
when the engine falls idle."""

from __future__ import annotations

import pytest

from worker import engine_process
from worker.core import EngineCore
from worker.engine import StepOutput
from worker.engine_process import COALESCE_S, _Outbox
from worker.sim import SimEngine
from worker.wire import Step


class FakeChannel:
    def __init__(self) -> None:
        self.sent: list[Step] = []

    def send(self, msg: Step) -> None:
        self.sent.append(msg)


def test_quick_steps_share_a_message_slow_ones_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(engine_process.time, "perf_counter", lambda: clock[0])
    channel = FakeChannel()
    outbox = _Outbox(channel, SimEngine(), EngineCore(SimEngine()))  # type: ignore[arg-type]
    outbox.add([StepOutput("a")], stepped=True)
    outbox.send(now=False)  # the first: nothing was sent for a long while
    assert [len(m.outputs) for m in channel.sent] == [1]
    for n in range(3):  # three steps within COALESCE_S of that send: held
        clock[0] += COALESCE_S / 4
        outbox.add([StepOutput(f"b{n}")], stepped=True)
        outbox.send(now=False)
    assert len(channel.sent) == 1
    clock[0] += COALESCE_S / 2  # past it: the three go out together
    outbox.add([StepOutput("c")], stepped=True)
    outbox.send(now=False)
    assert [m.steps for m in channel.sent] == [1, 4]
    assert [o.job_id for o in channel.sent[1].outputs] == ["b0", "b1", "b2", "c"]
    clock[0] += COALESCE_S / 4
    outbox.add([StepOutput("d", finish_reason="length")], stepped=True)
    outbox.send(now=True)  # the engine falls idle: nothing stays behind
    assert [o.job_id for o in channel.sent[-1].outputs] == ["d"]
    outbox.send(now=True)
    assert len(channel.sent) == 3  # nothing pending, nothing sent


def test_the_step_profile_logs_each_intervals_steps_and_counter_differences(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """GENQ_STEP_PROFILE_S: a line per interval, with the engine's `profile()` counters as
    differences since the last line."""
    clock = [0.0]
    monkeypatch.setattr(engine_process.time, "perf_counter", lambda: clock[0])
    engine = SimEngine()
    counters = {"consumed": 0, "consume_s": 0.0}
    engine.profile = lambda: dict(counters)  # type: ignore[attr-defined]
    core = EngineCore(engine)
    profile = engine_process._Profile(engine, every_s=5.0)
    with caplog.at_level("INFO", logger="worker.engine_process"):
        for _ in range(3):
            clock[0] += 1.0
            counters["consumed"] += 10
            counters["consume_s"] += 0.5
            core.last_step_s = 0.02
            profile.stepped(core, [StepOutput("a", token_ids=[1, 2])])
        assert not caplog.records  # within the interval: nothing yet
        clock[0] += 2.5
        profile.stepped(core, [StepOutput("a", token_ids=[3])])
    [line] = caplog.records
    assert line.msg == "engine profile"
    fields = line.__dict__
    assert (fields["steps"], fields["tokens"], fields["consumed"]) == (4, 7, 30)
    assert fields["consume_s"] == 1.5 and fields["step_ms"] == 20.0
