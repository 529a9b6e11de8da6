"""The exllamav3 engine's own logic — admission, cancel, results and errors → StepOutputs, the
sampler each job gets — against a fake generator with exllamav3's methods, page accounting and
result dialects (stages, serials, `error` results without an identifier, `requeue`). No torch
here (CI runs on CPU)."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from shared.schemas import ModelCard, Sampling
from shared.settings import Settings
from worker.admission import Admission
from worker.core import AddCommand, EngineCore
from worker.dyngen.backend import Backend
from worker.engine import EngineJob, StepOutput, reserved_tokens
from worker.exl3 import loader
from worker.exl3.engine import ExLlamaV3Engine
from worker.exl3.sampling import checked_kwargs, combo_args

PAGE = 256
EOS_ID = 2
PIECES = {EOS_ID: ""}  # special tokens decode to nothing (decode_special_tokens=False)


def piece(token_id: int) -> str:
    return PIECES.get(token_id, f"t{token_id} ")


@dataclass
class FakeJob:
    ids: list[int]
    max_new: int
    sampling: Sampling
    seed: int
    stops: list[int | str]
    identifier: str
    script: list[int]
    """Token ids this job will sample, in order."""
    new: int = 0
    held: list[int] = field(default_factory=list)

    @property
    def pages(self) -> int:
        # exllamav3 holds prompt + max_new_tokens + 1 tokens of pages per job
        return math.ceil((len(self.ids) + self.max_new + 1) / PAGE)

    def current_new_pages_required(self) -> int:
        return self.pages


class FakePageTable:
    def __init__(self, pages: int) -> None:
        self.max_pages = pages
        self.free = pages

    def num_unreferenced_pages(self) -> int:
        return self.free


class FakeGenerator:
    """exllamav3's Generator as the engine uses it: `enqueue` returns a serial that every
    result carries (with the job; the identifier too, except on `error` results); a job holds
    its pages from start to end; one token per job per step. Knobs: `fail_next` (iterate
    raises), `fail_jobs` (their next step is an `error` result), `requeue_jobs` (their next
    result carries `requeue`)."""

    def __init__(self, pages: int, max_batch: int) -> None:
        self.pagetable = FakePageTable(pages)
        self.max_batch_size = max_batch
        self.pending_jobs: list[FakeJob] = []
        self.active_jobs: list[FakeJob] = []
        self.serials: dict[int, FakeJob] = {}
        self.cancelled: list[str] = []
        self.closed = False
        self.fail_next = False
        self.fail_jobs: set[str] = set()
        self.requeue_jobs: set[str] = set()

    def enqueue(self, job: FakeJob) -> int:
        assert job.pages <= self.pagetable.max_pages, "Job requires too many pages"
        serial = len(self.serials)
        self.serials[serial] = job
        self.pending_jobs.append(job)
        return serial

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def serial(self, job: FakeJob) -> int:
        return next(s for s, j in self.serials.items() if j is job)

    def cancel(self, job: FakeJob) -> None:
        self.cancelled.append(job.identifier)
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            self._release(job)

    def close(self) -> None:
        self.closed = True

    def _release(self, job: FakeJob) -> None:
        self.active_jobs.remove(job)
        self.pagetable.free += job.pages

    def iterate(self) -> list[dict[str, Any]]:
        if self.closed:
            raise RuntimeError("This Generator no longer owns its Cache")
        if self.fail_next:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        results: list[dict[str, Any]] = []
        for job in list(self.pending_jobs):
            if len(self.active_jobs) < self.max_batch_size and job.pages <= self.pagetable.free:
                self.pending_jobs.remove(job)
                self.active_jobs.append(job)
                self.pagetable.free -= job.pages
                base = {"job": job, "serial": self.serial(job), "identifier": job.identifier}
                results.append({**base, "stage": "started", "eos": False})
                n = len(job.ids)
                progress = {"curr_progress": n, "max_progress": n}
                results.append({**base, "stage": "prefill", "eos": False, **progress})
        for job in list(self.active_jobs):
            if job.identifier in self.fail_jobs:
                self._release(job)
                error = RuntimeError("NonFiniteLogits: 3 non-finite logits")
                serial = self.serial(job)
                results.append(
                    {"job": job, "serial": serial, "stage": "error", "eos": True, "error": error}
                )
                continue
            results.append(self._sample(job))
        return results

    def _sample(self, job: FakeJob) -> dict[str, Any]:
        token = job.script[job.new]
        job.new += 1
        job.held.append(token)
        r: dict[str, Any] = {
            "job": job,
            "serial": self.serial(job),
            "identifier": job.identifier,
            "stage": "streaming",
            "eos": False,
        }
        if job.identifier in self.requeue_jobs:
            r["requeue"] = True
        held_text = "".join(piece(t) for t in job.held)
        if token in job.stops:
            r.update(
                eos=True,
                eos_reason="stop_token",
                eos_triggering_token_id=token,
                held={"text": held_text, "token_ids": [job.held]},
                cached_tokens=0,
            )
            self._release(job)
            return r
        stop = next((s for s in job.stops if isinstance(s, str) and s in held_text), None)
        if stop is not None:
            r.update(
                eos=True,
                eos_reason="stop_string",
                eos_triggering_string=stop,
                text=held_text.split(stop)[0],
                token_ids=[job.held],
                cached_tokens=0,
            )
            self._release(job)
            return r
        if any(isinstance(s, str) and held_text.endswith(s[:1]) for s in job.stops):
            return r  # could begin a stop string: hold
        r.update(
            text=held_text,
            token_ids=[job.held],
            token_probs=[[0.5] * len(job.held)],
            top_k_tokens=[[[t, 7] for t in job.held]],
            top_k_probs=[[[0.5, 0.25] for _ in job.held]],
        )
        job.held = []
        if job.new >= job.max_new:
            r.update(eos=True, eos_reason="max_new_tokens", cached_tokens=256)
            self._release(job)
        elif job.script[job.new] == LOOP:
            r.update(eos=True, eos_reason="loop_detected", cached_tokens=0)
            self._release(job)
        return r


LOOP = -1
"""In a script: exllamav3's loop detector ends the job before this token."""


@dataclass
class Harness:
    engine: ExLlamaV3Engine
    gens: list[FakeGenerator]
    jobs: list[FakeJob]
    unloaded: list[bool]

    @property
    def gen(self) -> FakeGenerator:
        return self.gens[-1]


def make(
    pages: int = 8,
    max_batch: int = 4,
    scripts: dict[str, list[int]] | None = None,
    max_seq_len: int = 4096,
) -> Harness:
    gens: list[FakeGenerator] = []
    jobs: list[FakeJob] = []
    unloaded: list[bool] = []

    def make_generator() -> FakeGenerator:
        gens.append(FakeGenerator(pages, max_batch))
        return gens[-1]

    def make_job(ids, max_new, sampling, seed, stops, identifier):  # type: ignore[no-untyped-def]
        script = (scripts or {}).get(identifier, list(range(100, 100 + max_new)))
        jobs.append(FakeJob(ids, max_new, sampling, seed, stops, identifier, script))
        return jobs[-1]

    card = ModelCard(
        name="fake",
        engine="exllamav3",
        max_seq_len=max_seq_len,
        max_batch=max_batch,
        tokenizer_sha="0",
        eos_token_ids=[EOS_ID],
    )
    backend = Backend(make_generator, make_job, piece, lambda: unloaded.append(True))
    return Harness(ExLlamaV3Engine(backend, card, "{}"), gens, jobs, unloaded)


def job(job_id: str, prompt: int = 100, max_tokens: int = 4, **sampling: Any) -> EngineJob:
    return EngineJob(job_id, list(range(10, 10 + prompt)), max_tokens, Sampling(**sampling), seed=7)


def run_to_end(engine: ExLlamaV3Engine, limit: int = 100) -> list[StepOutput]:
    out = []
    for _ in range(limit):
        if not engine.active():
            return out
        out += engine.step()
    raise AssertionError("jobs did not finish")


def by_job(outputs: list[StepOutput]) -> dict[str, list[StepOutput]]:
    out: dict[str, list[StepOutput]] = {}
    for o in outputs:
        out.setdefault(o.job_id, []).append(o)
    return out


def test_importing_the_engine_needs_no_torch() -> None:
    modules = "worker.exl3, worker.exl3.engine, worker.exl3.loader, worker.exl3.results, " + (
        "worker.exl3.sampling, worker.exl3.batch_sampling"
    )
    code = f"import sys, {modules}; assert not {{'torch', 'exllamav3'}} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- admission ----------------------------------------------------------------------------
# The worker admits jobs against what the engine reports (worker/admission.py); `Boundary` is
# both sides, the engine process's core applying what the worker sent and reporting back.


class Boundary:
    def __init__(self, h: Harness) -> None:
        e = self.engine = h.engine
        self.admission = Admission(
            e.max_batch, e.page_size, e.total_pages, e.free_pages(), reserved_tokens(e)
        )
        self.core = EngineCore(e)
        self._sent: list[AddCommand] = []

    def fits(self, tokens: int, active: int) -> bool:
        return self.admission.fits(tokens, active)

    def send(self, j: EngineJob) -> None:
        self.admission.sent(len(j.input_ids) + j.max_tokens)
        self._sent.append(AddCommand(j, 1))

    def deliver(self) -> list[StepOutput]:
        commands, self._sent = self._sent, []
        out = self.core.apply(commands)
        self.admission.report(self.engine.free_pages(), self.core.adds)
        return out

    def run_to_end(self) -> None:
        run_to_end(self.engine)
        self.admission.report(self.engine.free_pages(), self.core.adds)


def test_fits_counts_batch_slots() -> None:
    b = Boundary(make(pages=100, max_batch=2))
    assert b.fits(300, active=1)
    assert not b.fits(300, active=2)


def test_the_engine_says_it_holds_one_token_more_than_the_job() -> None:
    assert make().engine.reserved_tokens == 1


def test_fits_counts_the_token_exllamav3_reserves_beyond_the_job() -> None:
    b = Boundary(make(pages=4))
    assert b.fits(2 * PAGE, active=0)  # 513 tokens of pages: 3, 1 left
    assert not b.fits(PAGE, active=1)  # 257: 2 pages
    assert b.fits(PAGE - 1, active=1)


def test_fits_reserves_pages_until_the_engine_reports_the_add() -> None:
    b = Boundary(make(pages=8))
    # 3 pages each (600 + 1 tokens): two fit in 8 pages, a third does not, even before an add.
    assert b.fits(600, active=0)
    assert b.fits(600, active=1)
    assert not b.fits(600, active=2)
    b.send(job("a", prompt=500, max_tokens=100))
    b.send(job("b", prompt=500, max_tokens=100))
    assert not b.fits(600, active=2)  # sent, not applied: still reserved
    b.deliver()
    assert b.admission.free_pages == 2  # both wait inside the generator: their pages not free
    assert not b.fits(600, active=2)
    assert b.fits(2 * PAGE - 1, active=2)  # the 2 pages left


def test_pages_waiting_inside_the_generator_are_not_free() -> None:
    h = make(pages=8)
    h.engine.add(job("a", prompt=500, max_tokens=100))  # pending in the generator: 3 pages
    assert h.gen.pending_jobs and h.gen.pagetable.num_unreferenced_pages() == 8
    assert h.engine.free_pages() == 5


def test_pages_come_back_when_jobs_finish() -> None:
    b = Boundary(make(pages=4))
    assert b.fits(4 * PAGE - 1, active=0)
    b.send(job("a", prompt=1000, max_tokens=23))
    b.deliver()
    assert not b.fits(PAGE - 1, active=1)
    b.run_to_end()
    assert b.engine.free_pages() == 4
    assert b.fits(4 * PAGE - 1, active=0)


def test_a_job_larger_than_the_whole_cache_is_refused_before_it_is_enqueued() -> None:
    h = make(pages=4)
    assert Boundary(h).fits(5 * PAGE, active=0)  # claimed, so that it fails, not waits forever
    with pytest.raises(ValueError, match=r"1024 tokens is over this worker's limit of 1023"):
        h.engine.add(job("big", prompt=4 * PAGE - 4, max_tokens=4))
    assert h.engine.active() == 0 and not h.gen.serials
    h.engine.add(job("fits", prompt=4 * PAGE - 5, max_tokens=4))  # 1023 + 1: the whole cache
    assert run_to_end(h.engine)[-1].finish_reason == "length"


def test_a_job_over_the_sequence_length_is_refused() -> None:
    h = make(pages=100, max_seq_len=1000)
    with pytest.raises(ValueError, match=r"1001 tokens is over this worker's limit of 1000"):
        h.engine.add(job("long", prompt=997, max_tokens=4))
    assert not h.gen.serials


def test_max_new_tokens_is_always_explicit() -> None:
    h = make()
    h.engine.add(job("a", prompt=10, max_tokens=7))
    assert h.jobs[0].max_new == 7


# ---- results ------------------------------------------------------------------------------


def test_tokens_stream_and_finish_with_length_and_usage() -> None:
    h = make()
    h.engine.add(job("a", prompt=100, max_tokens=3))
    out = run_to_end(h.engine)  # started and prefill results say nothing to the client
    assert [o.token_ids for o in out] == [[100], [101], [102]]
    assert "".join(o.text for o in out) == "t100 t101 t102 "
    last = out[-1]
    assert last.finish_reason == "length"
    assert (last.prompt_tokens, last.cached_tokens) == (100, 100)  # capped at the prompt
    assert all(o.finish_reason is None for o in out[:-1])


def test_stop_token_ends_with_stop_and_is_not_output() -> None:
    h = make(scripts={"a": [100, 101, EOS_ID, 103]})
    h.engine.add(job("a", max_tokens=4))
    out = run_to_end(h.engine)
    assert [t for o in out for t in o.token_ids] == [100, 101]
    assert out[-1].finish_reason == "stop"
    assert "".join(o.text for o in out) == "t100 t101 "


def test_text_held_before_a_stop_token_is_released() -> None:
    # "t" could begin the stop string "t5xx": held; then EOS arrives, so the held text is output.
    h = make(scripts={"a": [100, EOS_ID]})
    h.engine.add(job("a", max_tokens=4, stop=["t5xx"]))
    out = run_to_end(h.engine)
    assert "".join(o.text for o in out) == "t100 "
    assert [t for o in out for t in o.token_ids] == [100]
    assert out[-1].finish_reason == "stop"


def test_a_stop_token_id_with_text_is_not_output() -> None:
    h = make(scripts={"a": [100, 42, 101]})
    h.engine.add(job("a", max_tokens=3, stop_token_ids=[42]))
    out = run_to_end(h.engine)
    assert "".join(o.text for o in out) == "t100 "
    assert out[-1].finish_reason == "stop"


def test_stop_string_ends_with_stop() -> None:
    h = make(scripts={"a": [100, 101, 102]})
    h.engine.add(job("a", max_tokens=3, stop=["101"]))
    out = run_to_end(h.engine)
    assert "".join(o.text for o in out) == "t100 t"
    assert out[-1].finish_reason == "stop"


def test_a_detected_loop_ends_with_stop_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    h = make(scripts={"a": [100, 101, LOOP]})
    h.engine.add(job("a", max_tokens=8))
    with caplog.at_level(logging.INFO, logger="worker.exl3.results"):
        out = run_to_end(h.engine)
    assert out[-1].finish_reason == "stop" and [t for o in out for t in o.token_ids] == [100, 101]
    [record] = [r for r in caplog.records if getattr(r, "reason", None) == "loop_detected"]
    assert record.job_id == "a"  # type: ignore[attr-defined]


def test_stop_conditions_are_eos_plus_the_jobs_own() -> None:
    h = make()
    h.engine.add(job("a", stop=["END"], stop_token_ids=[42]))
    assert set(h.jobs[0].stops) == {EOS_ID, 42, "END"}


def test_a_job_whose_text_the_worker_makes_gets_token_ids_and_no_stop_strings() -> None:
    h = make(scripts={"a": [100, 101, 102]})
    j = job("a", max_tokens=3, stop=["101"], stop_token_ids=[42])
    j.text = False  # GENQ_DETOKENIZE=worker: the worker matches "101" in the text it makes
    h.engine.add(j)
    assert set(h.jobs[0].stops) == {EOS_ID, 42}
    out = run_to_end(h.engine)
    assert [t for o in out for t in o.token_ids] == [100, 101, 102]
    assert all(o.text == "" for o in out) and out[-1].finish_reason == "length"


def test_logprobs_are_mapped_per_token() -> None:
    h = make()
    h.engine.add(job("a", max_tokens=1, logprobs=2))
    (out,) = run_to_end(h.engine)
    assert out.logprobs == [
        {
            "token": "t100 ",
            "token_id": 100,
            "logprob": pytest.approx(math.log(0.5)),
            "top_logprobs": [
                {"token": "t100 ", "token_id": 100, "logprob": pytest.approx(math.log(0.5))},
                {"token": "t7 ", "token_id": 7, "logprob": pytest.approx(math.log(0.25))},
            ],
        },
    ]


def test_an_error_result_fails_that_job_alone() -> None:
    """exllamav3's `error` result names its job by serial only (no identifier)."""
    h = make()
    h.engine.add(job("a", max_tokens=3))
    h.engine.add(job("b", max_tokens=3))
    h.engine.step()  # both running
    h.gen.fail_jobs.add("a")
    out = by_job(run_to_end(h.engine))
    [failed] = out["a"]
    assert failed.error is not None and "NonFiniteLogits" in failed.error
    assert failed.finish_reason is None
    assert out["b"][-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in out["b"]) == 2  # its first token came in the first step
    assert h.engine.active() == 0 and h.engine.free_pages() == 8


def test_a_requeue_flag_is_ignored_and_the_job_goes_on() -> None:
    h = make()
    h.engine.add(job("a", max_tokens=3))
    h.gen.requeue_jobs.add("a")
    out = run_to_end(h.engine)
    assert [t for o in out for t in o.token_ids] == [100, 101, 102]
    assert [o.finish_reason for o in out] == [None, None, "length"]


def test_results_of_a_cancelled_job_are_dropped() -> None:
    h = make()
    h.engine.add(job("a", max_tokens=3))
    h.engine.step()
    stale = h.gen._sample(h.jobs[0])  # a result the generator made before the cancel
    h.engine.cancel("a")
    h.gen.iterate = lambda: [stale]  # type: ignore[method-assign]
    assert h.engine.step() == []


def test_resumed_job_prefills_sent_tokens_and_generates_the_rest() -> None:
    h = make()
    j = job("a", prompt=10, max_tokens=5)
    j.resume_ids = [500, 501]
    h.engine.add(j)
    assert h.jobs[0].ids[-2:] == [500, 501] and h.jobs[0].max_new == 3
    out = run_to_end(h.engine)
    assert sum(len(o.token_ids) for o in out) == 3
    assert out[-1].prompt_tokens == 10


def test_resumed_job_with_nothing_left_just_finishes() -> None:
    h = make()
    j = job("a", prompt=10, max_tokens=2)
    j.resume_ids = [500, 501]
    h.engine.add(j)
    (out,) = run_to_end(h.engine)
    assert out.finish_reason == "length" and not out.token_ids and not h.jobs


# ---- cancel and reset ---------------------------------------------------------------------


def test_cancel_frees_the_pages_and_reports_running() -> None:
    h = make(pages=8)
    e = h.engine
    e.add(job("a", prompt=1000, max_tokens=23))
    e.step()
    assert e.free_pages() == 4
    assert e.cancel("a") is True
    assert h.gen.cancelled == ["a"]
    assert e.free_pages() == 8 and e.active() == 0
    assert e.cancel("a") is False
    assert e.cancel("never-seen") is False


def test_cancel_of_a_job_waiting_for_pages() -> None:
    h = make(pages=4)
    e = h.engine
    e.add(job("a", prompt=1000, max_tokens=23))
    e.add(job("b", prompt=1000, max_tokens=23))
    e.step()
    assert [j.identifier for j in h.gen.pending_jobs] == ["b"]
    assert e.cancel("b") is True
    assert not h.gen.pending_jobs


def test_a_failed_iterate_closes_the_generator_and_builds_one_over_the_same_model() -> None:
    h = make()
    e = h.engine
    e.add(job("a"))
    e.add(job("b"))
    h.gen.fail_next = True
    with pytest.raises(RuntimeError):
        e.step()
    first = h.gen
    assert sorted(e.reset()) == ["a", "b"]
    assert first.closed and len(h.gens) == 2 and not h.unloaded  # no reload
    assert e.active() == 0 and e.free_pages() == 8
    e.add(job("c", max_tokens=2))
    assert run_to_end(e)[-1].finish_reason == "length"


def test_close_cancels_closes_and_unloads() -> None:
    h = make()
    h.engine.add(job("a"))
    h.engine.close()
    assert h.gen.cancelled == ["a"] and h.gen.closed and h.unloaded == [True]


# ---- sampler ------------------------------------------------------------------------------


class FakeComboSampler:
    """exllamav3's ComboSampler signature (no **kwargs)."""

    def __init__(
        self,
        rep_p: float = 1.0,
        freq_p: float = 0.0,
        pres_p: float = 0.0,
        rep_sustain_range: int = int(10e7),
        rep_decay_range: int = 0,
        dry_multiplier: float = 0.0,
        dry_base: float = 1.75,
        dry_allowed_length: int = 2,
        dry_range: int = 0,
        dry_sequence_breakers: Any = None,
        temperature: float = 1.0,
        min_p: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        temp_last: bool = False,
        adaptive_target: float = 1.0,
        adaptive_decay: float = 0.9,
        logit_bias: Any = None,
    ) -> None:
        self.args = dict(locals())
        del self.args["self"]


class FakeDefaultSampler:
    """What exllamav3 gives a job with no sampler: min_p 0.08, temperature 0.8."""


class FakeExl3Job:
    """exllamav3's Job signature: what it does not name goes into **kwargs, unused."""

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int | None = None,
        min_new_tokens: int = 0,
        max_skips: int | None = 4,
        sampler: Any = None,
        seed: int | None = None,
        stop_conditions: Any = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        return_probs: bool = False,
        filters: Any = None,
        token_healing: bool = False,
        identifier: object | None = None,
        banned_strings: Any = None,
        embeddings: Any = None,
        max_rq_tokens: int | None = None,
        stop_on_loop: Any = None,
        rq_state: Any = None,
        **kwargs: Any,
    ) -> None:
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.banned_strings = banned_strings
        self.sampler = sampler if sampler is not None else FakeDefaultSampler()
        self.seed = seed
        self.stop_conditions = stop_conditions
        self.return_top_tokens = return_top_tokens
        self.return_probs = return_probs
        self.identifier = identifier
        self.max_rq_tokens = max_rq_tokens


SAMPLINGS = [
    Sampling(),
    Sampling(temperature=0.0, top_k=40, top_p=0.5, min_p=0.1, repetition_penalty=1.2),
    Sampling(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logprobs=3,
    ),
    Sampling(logit_bias={"5": -100.0, "9": 2.5}, min_tokens=3, banned_strings=["No"]),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_each_job_gets_exactly_the_sampler_genq_asked_for(sampling: Sampling) -> None:
    make_job = loader.job_factory(FakeExl3Job, FakeComboSampler, lambda ids: ("ids", ids))
    j = make_job([5, 6, 7], 11, sampling, 99, [EOS_ID, "END"], "job-1")
    assert isinstance(j.sampler, FakeComboSampler)
    assert j.sampler.args == combo_args(sampling)
    assert j.max_new_tokens == 11 and j.seed == 99 and j.identifier == "job-1"
    assert j.input_ids == ("ids", [5, 6, 7]) and j.stop_conditions == [EOS_ID, "END"]
    assert (j.return_probs, j.return_top_tokens) == (
        sampling.logprobs is not None,
        sampling.logprobs or 0,
    )
    assert j.max_rq_tokens is None  # no token budget: the generator never requeues a job
    assert (j.min_new_tokens, j.banned_strings) == (
        sampling.min_tokens,
        sampling.banned_strings or None,
    )
    assert j.sampler.args["logit_bias"] == ({5: -100.0, 9: 2.5} if sampling.logit_bias else None)


def test_an_argument_exllamav3_would_ignore_is_refused() -> None:
    args = loader.job_args("ids", 4, FakeComboSampler(), 1, [], "j", Sampling())
    assert checked_kwargs(FakeExl3Job, args) is args
    with pytest.raises(TypeError, match="gen_settings"):
        checked_kwargs(FakeExl3Job, {**args, "gen_settings": object()})
    with pytest.raises(TypeError, match="temprature"):
        checked_kwargs(FakeComboSampler, {**combo_args(Sampling()), "temprature": 0.5})


def test_sampler_args_are_neutral_by_default() -> None:
    a = combo_args(Sampling())
    assert (a["temperature"], a["top_k"], a["top_p"], a["min_p"]) == (1.0, 0, 1.0, 0.0)
    assert (a["rep_p"], a["pres_p"], a["freq_p"]) == (1.0, 0.0, 0.0)
    assert a["dry_multiplier"] == 0.0 and a["adaptive_target"] == 1.0 and a["logit_bias"] is None
    assert set(a) == set(FakeComboSampler().args)  # every argument, none left to its default


def test_temperature_zero_is_greedy_and_keeps_the_penalties() -> None:
    a = combo_args(Sampling(temperature=0.0, top_k=40, top_p=0.5, repetition_penalty=1.3))
    assert a["temperature"] == 0.0  # ComboSampler: argmax
    assert (a["top_k"], a["top_p"], a["min_p"]) == (0, 1.0, 0.0)
    assert a["rep_p"] == 1.3


def test_sampler_args_carry_the_request() -> None:
    a = combo_args(SAMPLINGS[2])
    assert (a["temperature"], a["top_p"], a["top_k"], a["min_p"]) == (0.7, 0.9, 40, 0.05)
    assert (a["rep_p"], a["pres_p"], a["freq_p"]) == (1.1, 0.5, 0.25)


# ---- the generator's shape ----------------------------------------------------------------


class FakeExl3Generator:
    """exllamav3's Generator signature (abridged), with its **kwargs."""

    def __init__(
        self,
        model: Any,
        cache: Any,
        tokenizer: Any,
        max_batch_size: int = 256,
        max_chunk_size: int = 2048,
        shared_chunk_size: int | None = None,
        prefill_cooldown: int | None = 4,
        max_q_size: int = 8,
        **kwargs: Any,
    ) -> None:
        self.prefill_cooldown = prefill_cooldown
        self.shared_chunk_size = shared_chunk_size


def test_scheduling_settings_reach_the_generator() -> None:
    s = Settings(max_batch=8, cache_tokens=8192, prefill_cooldown=2, shared_chunk_size=600)
    shape = loader.shape_for(s, 4096)
    build = loader.generator_builder(FakeExl3Generator, loader.generator_kwargs(1, 2, 3, shape))
    gen = build()
    assert gen.prefill_cooldown == 2
    assert gen.shared_chunk_size == 768  # whole pages
    with pytest.raises(TypeError, match="max_seq_len"):
        loader.generator_builder(FakeExl3Generator, {"max_seq_len": 4096})


def test_chunks_fit_the_cache_and_the_sequence_length_leaves_exllamav3_its_token() -> None:
    s = Settings(max_batch=1, cache_tokens=768, max_chunk_size=2048)
    shape = loader.shape_for(s, 4096)
    assert (shape.cache_tokens, shape.chunk, shape.shared_chunk) == (768, 768, 768)
    assert shape.max_seq_len == 767
    default = loader.shape_for(Settings(max_batch=4), 131_072)
    assert default.cache_tokens == 131_072 and default.max_seq_len == 131_071
    assert default.shared_chunk == default.chunk == 2048
    capped = loader.shape_for(Settings(max_batch=4, shared_chunk_size=4096), 8192)
    assert capped.shared_chunk == 2048


def test_warm_up_runs_each_batch_size_and_a_long_prefill() -> None:
    s = Settings(max_batch=24, cache_tokens=64 * PAGE, max_chunk_size=512)
    shape = loader.shape_for(s, 4096)
    gen = FakeGenerator(64, 24)
    made: list[FakeJob] = []

    def make_job(ids, max_new, sampling, seed, stops, identifier):  # type: ignore[no-untyped-def]
        made.append(FakeJob(ids, max_new, sampling, seed, stops, identifier, list(range(max_new))))
        return made[-1]

    loader.warm_up(gen, make_job, shape, vocab=4096, min_jobs=16)
    runs: dict[str, int] = {}
    for j in made:
        label = j.identifier.split("-")[1]
        runs[label] = runs.get(label, 0) + 1
    graphs = {f"graph{n}": n for n in range(1, loader.GRAPH_BATCHES + 1)}
    assert runs == {**graphs, "batch16": 16, "batch24": 24, "plain": 16, "burst": 24, "long": 1}
    assert len(made[-1].ids) == 2 * 512 and not gen.num_remaining_jobs()
    library = [loader.for_library(s) for s in loader.WARMUP_SAMPLINGS]
    assert all(any(j.sampling == s for j in made) for s in library)
    # genq's edits get their jobs too, the library neither the bias nor the minimum
    edited = [j for j in made if getattr(j, "genq_min_tokens", 0)]
    assert edited and all(j.sampling.min_tokens == 0 and not j.sampling.logit_bias for j in edited)
    assert all(j.genq_bias == ([loader.WARMUP_LOWEST_TOKEN], [1.0]) for j in edited)
    lengths = {len(j.ids) for j in made if j.identifier.startswith("warmup-burst")}
    assert lengths == set(loader.WARMUP_PROMPTS)


def test_the_warm_up_plan_meets_every_size_and_prompt_the_first_burst_does() -> None:
    shape = loader.shape_for(Settings(max_batch=256, max_chunk_size=2048), 8192)
    plan = loader.warmup_plan(shape, min_jobs=16)
    sizes = [r.jobs for r in plan]
    assert sizes[: loader.GRAPH_BATCHES] == list(range(1, loader.GRAPH_BATCHES + 1))
    assert {16, 32, 64, 128, 256} <= set(sizes) and max(sizes) == 256
    burst = next(r for r in plan if r.label == "burst")
    assert burst.jobs == 256 and any(n % 16 for n in burst.prompts)
    assert any(n % 16 == 0 for n in burst.prompts)
    plain = next(r for r in plan if r.label == "plain")
    assert plain.jobs >= 16 and plain.samplings == (Sampling(),)  # the pass, untruncated
    assert plan[-1].prompts == (2 * 2048,)
    small = loader.warmup_plan(loader.shape_for(Settings(max_batch=4, cache_tokens=1024), 300))
    assert [r.jobs for r in small][:4] == [1, 2, 3, 4] and max(r.jobs for r in small) == 4
    assert all(n + loader.WARMUP_NEW_TOKENS <= 300 for r in small for n in r.prompts)
