"""The GPU benchmark's bare loop (genq/benchgpu.py `Bare`), against a fake generator with
exllamav2's methods: closed loop by default; with `arrivals`, each job is enqueued no
earlier than its time, in the order of those times (the system's clients' send times)."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from genq import benchgpu
from genq.benchgpu import Bare, Job, Turns
from shared.settings import Settings

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


def test_the_mean_batch_per_step_is_reported_for_both() -> None:
    bare, _ = _bare()
    row = bare.run(JOBS, streams=2)  # 2 at a time, 3 tokens each: 12 tokens in 6 steps
    assert row["steps"] == 6 and row["tokens_per_step"] == 2.0
    system = {**row, "run": "system", "tokens_per_step": 1.5}
    assert benchgpu.ratio(row, system)["tokens_per_step"] == {"bare": 2.0, "system": 1.5}


def test_the_sampler_probe_adds_its_figures_to_the_row(monkeypatch: pytest.MonkeyPatch) -> None:
    class Probe(benchgpu.SamplerTimer):  # exllamav3's Job.receive_logits, timed: 3 calls, 6 ms
        def __enter__(self) -> Probe:
            self.seconds, self.calls = 0.006, 3
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(benchgpu, "SamplerTimer", Probe)
    bare, _ = _bare()
    bare.probe = True
    row = bare.run(JOBS, streams=2)
    assert row["steps"] == 6 and row["tokens"] == 12
    assert row["sampler_calls"] == 3 and row["sampler_launch_ms_per_step"] == 1.0
    assert 0 < row["sampler_launch_share"] <= 1


def test_a_batched_sampler_reports_its_tokens_and_its_cost_per_step() -> None:
    """exllamav3 with GENQ_BATCHED_SAMPLING: the pass's own host time beside the per-job
    launches it replaces (the probe's figures)."""
    bare, backend = _bare()
    gen = FakeGenerator()
    gen.genq_sampler = SimpleNamespace(batched_tokens=8, seconds=0.012)  # type: ignore[attr-defined]
    backend.make_generator = lambda: gen  # type: ignore[method-assign]
    row = bare.run(JOBS, streams=2)
    assert row["steps"] == 6
    assert row["batched_tokens"] == 8 and row["batched_pass_ms_per_step"] == 2.0
    bare, _ = _bare()
    assert "batched_tokens" not in bare.run(JOBS, streams=2)  # exllamav3's own sampler


def test_the_bare_loop_keeps_exllamav3s_own_sampler_unless_its_environment_asks() -> None:
    """The worker samples in one batched pass by default; the loop it is measured against is
    the stock one, unless GENQ_BATCHED_SAMPLING is set for the benchmark itself."""
    base = Settings(engine="exllamav3", model_dir="/m")
    assert base.batched_sampling  # the worker's default
    assert not benchgpu.stock_unless_asked(base, {}).batched_sampling
    asked = Settings(engine="exllamav3", model_dir="/m", batched_sampling=True)
    assert benchgpu.stock_unless_asked(asked, {"GENQ_BATCHED_SAMPLING": "true"}).batched_sampling
    off = Settings(engine="exllamav3", model_dir="/m", batched_sampling=False)
    assert not benchgpu.stock_unless_asked(off, {"GENQ_BATCHED_SAMPLING": "false"}).batched_sampling


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


def test_turns_alternate_who_goes_first_and_report_the_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    # warm-up (system, bare), then bare, system, system, bare, bare, system
    speed = iter([1.0, 1.0, 100.0, 95.0, 90.0, 99.0, 80.0, 60.0])

    def fake_system(system: Any, jobs: list[Job], streams: int, label: str, *_: Any) -> dict:
        order.append("system")
        return {"streams": streams, "tokens_per_s": next(speed), "ttft_ms_p50": 10.0}

    class FakeBare:
        def run(self, jobs: list[Job], streams: int, arrivals: Any = None) -> dict:
            assert arrivals is None
            order.append("bare")
            return {"streams": streams, "tokens_per_s": next(speed), "ttft_ms_p50": 8.0}

    monkeypatch.setattr(benchgpu, "run_system", fake_system)
    monkeypatch.setattr(benchgpu, "_vocab", lambda model: 1000)
    turns = Turns.__new__(Turns)
    turns.bare, turns.extra = FakeBare(), {}  # type: ignore[assignment]
    turns.system = SimpleNamespace(model=None)  # type: ignore[assignment]
    rows: list[dict] = []
    turns.run([8], 3, lambda c: JOBS, rows.append, {})
    assert order[2:] == ["bare", "system", "system", "bare", "bare", "system"]  # after warm-up
    per_round = [r["tokens_per_s"] for r in rows if r.get("run") == "ratio system/bare"]
    assert per_round == [0.95, round(90 / 99, 3), 0.75]
    [summary] = [r for r in rows if r.get("run") == "ratio system/bare, median of the rounds"]
    assert summary["tokens_per_s"] == {"median": round(90 / 99, 3), "min": 0.75, "max": 0.95}
    assert summary["ttft_p50_overhead_ms"]["median"] == 2.0


def test_an_option_takes_its_turns_beside_the_defaults_against_the_same_bare_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--ab-worker-env`: a second system (the option) turns with the bare loop and the
    defaults' system, none always first; each round both are measured against that round's
    bare turn, and the option against the defaults directly."""
    order: list[str] = []
    speed = {  # tokens/s by round and turn; the host drifts: round 1 is slower for everyone
        0: {"bare": 100.0, "system": 90.0, "alt": 99.0},
        1: {"bare": 50.0, "system": 40.0, "alt": 48.0},
        2: {"bare": 100.0, "system": 95.0, "alt": 95.0},
    }
    now = {"round": -1}

    def fake_system(system: Any, jobs: list[Job], streams: int, label: str, *_: Any) -> dict:
        if label == "warm-up":
            return {}
        assert label == f"{system.name} compare"
        order.append(system.name)
        tps = speed[now["round"]][system.name]
        return {
            "run": label,
            "streams": streams,
            "tokens_per_s": tps,
            "ttft_ms_p50": 10.0,
            "engine_step_ms": 1000 / tps,
        }

    class FakeBare:
        def run(self, jobs: list[Job], streams: int, arrivals: Any = None) -> dict:
            if len(jobs) == 2:  # the warm-up
                return {}
            order.append("bare")
            return {
                "streams": streams,
                "tokens_per_s": speed[now["round"]]["bare"],
                "ttft_ms_p50": 8.0,
            }

    def report(row: dict) -> None:
        rows.append(row)

    def jobs_for(c: int) -> list[Job]:
        if not order or len(order) % 3 == 0:
            now["round"] += 1
        return JOBS

    monkeypatch.setattr(benchgpu, "run_system", fake_system)
    monkeypatch.setattr(benchgpu, "_vocab", lambda model: 1000)
    turns = Turns.__new__(Turns)
    turns.bare, turns.extra = FakeBare(), {}  # type: ignore[assignment]
    turns.system = SimpleNamespace(model=None, name="system")  # type: ignore[assignment]
    turns.alt = SimpleNamespace(name="alt")  # type: ignore[assignment]
    turns.alt_env = {"GENQ_ENGINE_GC_IN_STEPS": "false"}
    rows: list[dict] = []
    turns.run([8], 3, jobs_for, report, {})
    assert order == [
        *("bare", "system", "alt"),
        *("system", "alt", "bare"),
        *("alt", "bare", "system"),
    ]
    alt_rows = [r for r in rows if r.get("run") == "alt compare"]
    assert [r["alt_env"] for r in alt_rows] == [turns.alt_env] * 3

    def per_round(kind: str) -> list[float]:
        return [r["tokens_per_s"] for r in rows if r.get("run") == f"ratio {kind}"]

    assert per_round("system/bare") == [0.9, 0.8, 0.95]
    assert per_round("alt/bare") == [0.99, 0.96, 0.95]
    assert per_round("alt/system") == [1.1, 1.2, 1.0]
    [direct] = [r for r in rows if r.get("run") == "ratio alt/system, median of the rounds"]
    assert direct["tokens_per_s"] == {"median": 1.1, "min": 1.0, "max": 1.2}
    first = next(r for r in rows if r.get("run") == "ratio alt/system")
    assert first["step_ms"]["bare"] == 1000 / 90  # the defaults' engine step, beside the option's
    assert first["step_ms"]["engine"] == 1000 / 99
    medians = [r["run"] for r in rows if "median" in r.get("run", "")]
    assert medians == [
        "ratio system/bare, median of the rounds",
        "ratio alt/bare, median of the rounds",
        "ratio alt/system, median of the rounds",
    ]


def test_an_option_without_turns_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A second system only makes sense in turns: alone it would be measured under other drift."""
    with pytest.raises(SystemExit) as refused:
        benchgpu.main(["--model", "sim", "--sweep", "8", "--ab-worker-env", "GENQ_X=1"])
    assert refused.value.code == 2
    assert "--ab-worker-env takes its turns with --compare" in capsys.readouterr().err


def test_replayed_turns_give_the_bare_loop_the_systems_last_arrivals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    turns_seen: list[tuple[str, Any]] = []
    sends = iter([[0.0, 0.1], [0.0, 0.2], [0.0, 0.3]])

    def fake_system(
        system: Any, jobs: list[Job], streams: int, label: str, sent: Any = None
    ) -> dict:
        if sent is not None:
            sent.update(enumerate(next(sends)))
            turns_seen.append(("system", None))
        return {"streams": streams, "tokens_per_s": 10.0, "ttft_ms_p50": 1.0}

    class FakeBare:
        def run(self, jobs: list[Job], streams: int, arrivals: Any = None) -> dict:
            turns_seen.append(("bare", arrivals))
            return {"streams": streams, "tokens_per_s": 10.0, "ttft_ms_p50": 1.0}

    monkeypatch.setattr(benchgpu, "run_system", fake_system)
    monkeypatch.setattr(benchgpu, "_vocab", lambda model: 1000)
    turns = Turns.__new__(Turns)
    turns.bare, turns.extra = FakeBare(), {}  # type: ignore[assignment]
    turns.system = SimpleNamespace(model=None)  # type: ignore[assignment]
    turns.run([8], 3, lambda c: JOBS[:2], lambda row: None, {}, replay=True)
    turns_seen = turns_seen[1:]  # the bare loop's warm-up (the system's has no `sent`)
    assert turns_seen == [
        ("system", None),
        ("bare", [0.0, 0.1]),  # round 0: the system first, the bare loop its arrivals
        ("bare", [0.0, 0.1]),  # round 1: the bare loop first, the system's last arrivals
        ("system", None),  # [0.0, 0.2]
        ("system", None),  # [0.0, 0.3]
        ("bare", [0.0, 0.3]),
    ]


def test_pinned_turns_run_the_bare_loop_on_the_engines_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--pin-engine` with turns: each bare turn runs on the pin's CPU (the engine's, which
    its workers get as GENQ_ENGINE_CPUS), the system's turns off it."""
    pinned: list[bool] = []
    where = {"on": False}

    class FakePin:
        engine = 7

        def on_engine(self) -> Any:
            @contextlib.contextmanager
            def block() -> Any:
                where["on"] = True
                try:
                    yield
                finally:
                    where["on"] = False

            return block()

    def fake_system(system: Any, jobs: list[Job], streams: int, label: str, *_: Any) -> dict:
        pinned.append(where["on"])
        return {"streams": streams, "tokens_per_s": 1.0, "ttft_ms_p50": 1.0}

    class FakeBare:
        def run(self, jobs: list[Job], streams: int, arrivals: Any = None) -> dict:
            pinned.append(where["on"])
            return {"streams": streams, "tokens_per_s": 1.0, "ttft_ms_p50": 1.0}

    monkeypatch.setattr(benchgpu, "run_system", fake_system)
    monkeypatch.setattr(benchgpu, "_vocab", lambda model: 1000)
    turns = Turns.__new__(Turns)
    turns.bare, turns.extra, turns.pin = FakeBare(), {}, FakePin()  # type: ignore[assignment]
    turns.system = SimpleNamespace(model=None)  # type: ignore[assignment]
    turns.run([1], 2, lambda c: JOBS, lambda row: None, {})
    # warm-up (system, bare: unpinned), then round 0 bare, system; round 1 system, bare
    assert pinned == [False, False, True, False, False, True]


def test_pin_engine_gives_its_workers_the_engine_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turns built with a pin start their systems with GENQ_ENGINE_CPUS, this process (and so
    every process it starts) off that CPU."""
    envs: list[dict[str, str]] = []
    off: list[bool] = []

    class FakeSystem:
        def __init__(self, model: Any, args: Any, gateways: int, logs: Any, env: dict, *_: Any):
            envs.append(env)

        def wait_ready(self, *_: Any) -> None:
            pass

    pin = benchgpu.EnginePin(15, [0, 1, 2])
    monkeypatch.setattr(pin, "off_engine", lambda: off.append(True))
    monkeypatch.setattr(benchgpu, "Bare", lambda settings: None)
    monkeypatch.setattr(benchgpu, "System", FakeSystem)
    settings = Settings(engine="exllamav3", model_dir="/m")
    turns = Turns(
        settings, Path("/m"), [], 1, Path("/tmp/genq-pin-test"), {"A": "1"}, "x", None, pin
    )
    assert envs == [{"A": "1", "GENQ_ENGINE_CPUS": "15"}] and off == [True]
    assert turns.extra["env"] == envs[0]


def test_a_compare_call_runs_its_phases_in_order_and_closes_what_it_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--compare L --bare-again`, as `main` runs it: the bare loop at each level, the system
    at each (a ratio row each), the bare loop again after it, then with the system's own
    arrivals; every row in --json-out; the bare loop and the system each closed once."""
    events: list[str] = []

    class FakeBare:
        def __init__(self, settings: Settings, probe: bool = False) -> None:
            assert settings.max_batch == 4 and settings.cache_tokens == 4 * (512 + 256)

        def run(self, jobs: list[Job], streams: int, arrivals: Any = None) -> dict:
            events.append(f"bare {streams}" + (" replayed" if arrivals else ""))
            assert arrivals is None or arrivals == [float(i) for i in range(len(jobs))]
            return {"run": "bare generator", "streams": streams, "tokens_per_s": 100.0, **TTFT}

        def close(self) -> None:
            events.append("bare closed")

    class FakeSystem:
        def __init__(self, model: Any, args: list[str], *_: Any) -> None:
            assert args[:4] == ["--max-batch", "4", "--cache-tokens", str(4 * (512 + 256))]

        def wait_ready(self, workers: int) -> None:
            events.append("system ready")

        def close(self) -> None:
            events.append("system closed")

    def fake_system(system: Any, jobs: list[Job], streams: int, label: str, sent: Any = None):
        events.append(f"{label} {streams}")
        if sent is not None:
            sent.update({i: float(i) for i in range(len(jobs))})
        return {"run": label, "streams": streams, "tokens_per_s": 90.0, **TTFT}

    TTFT = {"ttft_ms_p50": 10.0}
    monkeypatch.setattr(benchgpu, "Bare", FakeBare)
    monkeypatch.setattr(benchgpu, "System", FakeSystem)
    monkeypatch.setattr(benchgpu, "run_system", fake_system)
    monkeypatch.setattr(benchgpu, "_vocab", lambda model: 1000)
    monkeypatch.setattr(benchgpu, "setup_logging", lambda settings: None)
    monkeypatch.setattr(benchgpu.signal, "signal", lambda *_: None)
    out = tmp_path / "rows.json"
    argv = ["--model", str(tmp_path), "--streams", "4", "--compare", "2,4", "--bare-again"]
    argv += ["--json-out", str(out), "--logs", str(tmp_path / "logs")]
    assert benchgpu.main(argv) == 0
    assert events == [
        "bare 2",
        "bare 4",
        "system ready",
        "warm-up 2",
        "system compare 2",
        "system compare 4",
        "system closed",
        "bare 2",
        "bare 2 replayed",
        "bare 4",
        "bare 4 replayed",
        "bare closed",
    ]
    runs = [r["run"] for r in json.loads(out.read_text())]
    assert runs == [
        *["bare generator"] * 2,
        *["system compare", "ratio system/bare"] * 2,
        *[
            "bare generator, after the system",
            "ratio system/bare after",
            "bare generator",
            "ratio system/bare, same arrivals",
        ]
        * 2,
    ]


def test_variant_turns_compare_each_variant_with_the_same_plain_jobs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--schema-compare 2 --min-tokens-compare 2,4`: one system; at 2 the three variants, at
    4 plain and min_tokens, who goes first moving each round; min_tokens asks max_tokens."""
    calls: list[tuple[str, int, Any]] = []
    speed = {"plain": 100.0, "schema": 90.0, "min_tokens": 97.0}

    class FakeSystem:
        def __init__(self, *_: Any) -> None:
            pass

        def wait_ready(self, workers: int) -> None:
            pass

        def close(self) -> None:
            calls.append(("closed", 0, None))

    def fake_system(
        system: Any, jobs: list[Job], streams: int, label: str, sent: Any = None, extra: Any = None
    ):
        calls.append((label, streams, extra))
        who = label.removeprefix("system, ")
        return {"run": label, "streams": streams, "tokens_per_s": speed.get(who, 1.0),
                "ttft_ms_p50": 10.0, "ttft_ms_p99": 20.0}  # fmt: skip

    monkeypatch.setattr(benchgpu, "System", FakeSystem)
    monkeypatch.setattr(benchgpu, "run_system", fake_system)
    monkeypatch.setattr(benchgpu, "_vocab", lambda model: 1000)
    monkeypatch.setattr(benchgpu, "setup_logging", lambda settings: None)
    monkeypatch.setattr(benchgpu.signal, "signal", lambda *_: None)
    out = tmp_path / "rows.json"
    argv = ["--model", str(tmp_path), "--schema-compare", "2", "--min-tokens-compare", "2,4"]
    argv += ["--rounds", "2", "--new-tokens", "16", "--json-out", str(out)]
    argv += ["--logs", str(tmp_path / "logs")]
    assert benchgpu.main(argv) == 0
    runs = [(label, c) for label, c, _ in calls if label not in ("warm-up", "closed")]
    assert runs == [
        ("system, plain", 2), ("system, schema", 2), ("system, min_tokens", 2),  # round 0
        ("system, min_tokens", 4), ("system, plain", 4),
        ("system, schema", 2), ("system, min_tokens", 2), ("system, plain", 2),  # round 1
        ("system, plain", 4), ("system, min_tokens", 4),
    ]  # fmt: skip
    bodies = {label: body for label, _, body in calls}
    assert bodies["system, min_tokens"] == {"min_tokens": 16}
    assert bodies["system, schema"] == {"json_schema": benchgpu.BENCH_SCHEMA}
    assert calls[-1][0] == "closed"
    rows = json.loads(out.read_text())
    medians = {(r["streams"], r["run"]): r for r in rows if "median" in r["run"]}
    assert set(medians) == {
        (2, "ratio schema/plain, median of the rounds"),
        (2, "ratio min_tokens/plain, median of the rounds"),
        (4, "ratio min_tokens/plain, median of the rounds"),
    }
    assert (
        medians[2, "ratio min_tokens/plain, median of the rounds"]["tokens_per_s"]["median"] == 0.97
    )


def test_the_first_burst_runs_a_fresh_bare_loop_then_a_fresh_system_per_level(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    events: list[str] = []

    class FakeBare:
        def __init__(self, settings: Settings, probe: bool = False) -> None:
            events.append("bare loaded")

        def run(self, jobs: list[Job], streams: int, arrivals: Any = None) -> dict:
            assert len(jobs) == streams and arrivals is None  # one burst, all at once
            events.append(f"bare {streams}")
            return {"run": "bare generator", "streams": streams, "tokens_per_s": 100.0,
                    "ttft_ms_p50": 200.0, "ttft_ms_p99": 300.0}  # fmt: skip

        def close(self) -> None:
            events.append("bare closed")

    class FakeSystem:
        def __init__(self, *_: Any) -> None:
            events.append("system started")

        def wait_ready(self, workers: int) -> None:
            pass

        def close(self) -> None:
            events.append("system closed")

    def fake_system(system: Any, jobs: list[Job], streams: int, label: str, *_: Any) -> dict:
        assert len(jobs) == streams
        events.append(f"{label} {streams}")
        return {"run": label, "streams": streams, "tokens_per_s": 96.0, "ttft_ms_p50": 250.0,
                "ttft_ms_p99": 320.0}  # fmt: skip

    monkeypatch.setattr(benchgpu, "Bare", FakeBare)
    monkeypatch.setattr(benchgpu, "System", FakeSystem)
    monkeypatch.setattr(benchgpu, "run_system", fake_system)
    monkeypatch.setattr(benchgpu, "_vocab", lambda model: 1000)
    monkeypatch.setattr(benchgpu, "setup_logging", lambda settings: None)
    monkeypatch.setattr(benchgpu.signal, "signal", lambda *_: None)
    out = tmp_path / "rows.json"
    argv = ["--model", str(tmp_path), "--first-burst", "2,4", "--json-out", str(out)]
    argv += ["--logs", str(tmp_path / "logs")]
    assert benchgpu.main(argv) == 0
    one = ["bare loaded", "bare {n}", "bare closed", "system started"]
    one += ["system, first burst {n}", "system closed"]
    assert events == [e.format(n=n) for n in (2, 4) for e in one]
    ratios = [r for r in json.loads(out.read_text()) if r["run"].startswith("ratio")]
    assert [r["run"] for r in ratios] == ["ratio system/bare, first burst"] * 2
    assert ratios[0]["tokens_per_s"] == 0.96 and ratios[0]["ttft_p50_overhead_ms"] == 50.0
    assert ratios[0]["ttft_p99_overhead_ms"] == 20.0
