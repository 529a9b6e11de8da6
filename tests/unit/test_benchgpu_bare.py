"""The GPU benchmark's bare loop (genq/benchgpu.py `Bare`), against a fake generator with
exllamav2's methods: closed loop by default; with `arrivals`, each job is enqueued no
earlier than its time, in the order of those times (the system's clients' send times)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from genq.benchgpu import Bare, Job

STEP_S = 0.002


class FakeIds:
    def __init__(self, n: int) -> None:
        self.shape = (1, n)


@dataclass
class FakeGenerator:
    enqueued: list[tuple[str, float]] = field(default_factory=list)
    jobs: dict[str, int] = field(default_factory=dict)
    """Tokens left per job."""

    def enqueue(self, handle: tuple[str, int]) -> None:
        self.enqueued.append((handle[0], time.perf_counter()))
        self.jobs[handle[0]] = handle[1]

    def num_remaining_jobs(self) -> int:
        return len(self.jobs)

    def iterate(self) -> list[dict[str, Any]]:
        time.sleep(STEP_S)
        out = []
        for key in list(self.jobs):
            self.jobs[key] -= 1
            eos = self.jobs[key] == 0
            if eos:
                del self.jobs[key]
            out.append(
                {"stage": "streaming", "identifier": key, "token_ids": FakeIds(1), "eos": eos}
            )
        return out


class FakeBackend:
    def __init__(self) -> None:
        self.gens: list[FakeGenerator] = []

    def make_generator(self) -> FakeGenerator:
        self.gens.append(FakeGenerator())
        return self.gens[-1]

    def make_job(self, ids: list[int], new: int, *_: Any) -> tuple[str, int]:
        return (_[-1], new)


def _bare() -> tuple[Bare, FakeBackend]:
    bare = Bare.__new__(Bare)
    backend = FakeBackend()
    bare.backend, bare.card, bare.probe = backend, SimpleNamespace(eos_token_ids=[2]), False
    return bare, backend


JOBS = [Job([5, 6, 7], 3, i) for i in range(4)]


def test_the_closed_loop_starts_a_job_as_one_ends() -> None:
    bare, backend = _bare()
    row = bare.run(JOBS, streams=2)
    assert row["tokens"] == 12 and row["jobs"] == 4
    [gen] = backend.gens
    assert [k for k, _ in gen.enqueued] == ["0", "1", "2", "3"]
    start = gen.enqueued[0][1]
    assert gen.enqueued[1][1] - start < STEP_S  # two at once, the others after 3 steps
    assert gen.enqueued[2][1] - start >= 3 * STEP_S


def test_replayed_jobs_arrive_at_their_times_in_their_order() -> None:
    bare, backend = _bare()
    arrivals = [0.0, 0.05, 0.02, 0.03]
    row = bare.run(JOBS, streams=2, arrivals=arrivals)
    assert row["run"] == "bare generator, the system's arrivals"
    assert row["tokens"] == 12 and row["jobs"] == 4
    [gen] = backend.gens
    assert [k for k, _ in gen.enqueued] == ["0", "2", "3", "1"]
    start = gen.enqueued[0][1]
    for key, at in gen.enqueued:
        assert at - start >= arrivals[int(key)] - 0.001
        assert at - start < arrivals[int(key)] + 0.25  # not all at once at the end
