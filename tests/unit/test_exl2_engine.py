"""The exllamav2 engine's own logic — cancel, results → StepOutputs, the pages it reports for
the worker's admission — against a fake generator with the same methods and page accounting.
No torch here (CI runs on CPU)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from shared.schemas import ModelCard, Sampling
from shared.settings import Settings
from worker import admission
from worker.admission import Admission
from worker.core import AddCommand, EngineCore
from worker.dyngen import backend
from worker.dyngen.backend import Backend
from worker.engine import EngineJob
from worker.exl2 import loader
from worker.exl2.engine import ExLlamaV2Engine
from worker.exl2.loader import sampler_fields
from worker.sim import SimEngine

PAGE = 256
EOS_ID = 2
PIECES = {EOS_ID: "</s>"}


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
        return math.ceil((len(self.ids) + self.max_new) / PAGE)

    def current_new_pages_required(self) -> int:
        return self.pages


class FakeGenerator:
    """Pages and batch slots like ExLlamaV2DynamicGenerator: a job holds all its pages from
    start to end; pending jobs start when their pages are free. One token per job per step."""

    def __init__(self, pages: int, max_batch: int, max_seq_len: int = 4096) -> None:
        self.page_size = PAGE
        self.max_pages = pages
        self.max_batch_size = max_batch
        self.max_seq_len = max_seq_len
        self.unreferenced_pages = {i: None for i in range(pages)}
        self.pending_jobs: list[FakeJob] = []
        self.active_jobs: list[FakeJob] = []
        self.cancelled: list[str] = []
        self.fail_next = False

    def enqueue(self, job: FakeJob) -> None:
        self.pending_jobs.append(job)

    def cancel(self, job: FakeJob) -> None:
        self.cancelled.append(job.identifier)
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            self._release(job)

    def _release(self, job: FakeJob) -> None:
        self.active_jobs.remove(job)
        start = max(self.unreferenced_pages, default=-1) + 1
        for i in range(job.pages):
            self.unreferenced_pages[start + i] = None

    def iterate(self) -> list[dict[str, Any]]:
        if self.fail_next:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        results: list[dict[str, Any]] = []
        for job in list(self.pending_jobs):
            if len(self.active_jobs) < self.max_batch_size and job.pages <= len(
                self.unreferenced_pages
            ):
                self.pending_jobs.remove(job)
                self.active_jobs.append(job)
                for _ in range(job.pages):
                    self.unreferenced_pages.popitem()
                results.append({"stage": "started", "identifier": job.identifier, "eos": False})
        for job in list(self.active_jobs):
            results.append(self._sample(job))
        return results

    def _sample(self, job: FakeJob) -> dict[str, Any]:
        token = job.script[job.new]
        job.new += 1
        job.held.append(token)
        r: dict[str, Any] = {"stage": "streaming", "identifier": job.identifier, "eos": False}
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
        return r


@dataclass
class Harness:
    engine: ExLlamaV2Engine
    gens: list[FakeGenerator]
    jobs: list[FakeJob]


def make(
    pages: int = 8, max_batch: int = 4, scripts: dict[str, list[int]] | None = None
) -> Harness:
    gens: list[FakeGenerator] = []
    jobs: list[FakeJob] = []

    def make_generator() -> FakeGenerator:
        gens.append(FakeGenerator(pages, max_batch))
        return gens[-1]

    def make_job(ids, max_new, sampling, seed, stops, identifier):  # type: ignore[no-untyped-def]
        script = (scripts or {}).get(identifier, list(range(100, 100 + max_new)))
        jobs.append(FakeJob(ids, max_new, sampling, seed, stops, identifier, script))
        return jobs[-1]

    card = ModelCard(
        name="fake",
        engine="exllamav2",
        max_seq_len=4096,
        max_batch=max_batch,
        tokenizer_sha="0",
        eos_token_ids=[EOS_ID],
    )
    engine = ExLlamaV2Engine(Backend(make_generator, make_job, piece), card, "{}")
    return Harness(engine, gens, jobs)


def job(job_id: str, prompt: int = 100, max_tokens: int = 4, **sampling: Any) -> EngineJob:
    return EngineJob(job_id, list(range(10, 10 + prompt)), max_tokens, Sampling(**sampling), seed=7)


def run_to_end(engine: ExLlamaV2Engine, limit: int = 100) -> list:
    out = []
    for _ in range(limit):
        if not engine.active():
            return out
        out += engine.step()
    raise AssertionError("jobs did not finish")


def test_importing_the_engine_needs_no_torch() -> None:
    modules = "worker.exl2.engine, worker.exl2.loader, worker.exl2.gpu_sampling, " + (
        "worker.dyngen.engine, worker.dyngen.results, worker.dyngen.batch_pass"
    )
    code = f"import sys, {modules}; assert not {{'torch', 'exllamav2'}} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- admission ------------------------------------------------------------------------------
# The worker admits jobs against what the engine last reported (worker/admission.py); here the
# engine's side of the boundary is the core the engine process runs, and its reports are
# passed by hand: `send` is the worker sending an add, `deliver` the engine process applying
# what was sent, each followed by the report its next Step message carries.


class Boundary:
    def __init__(self, h: Harness) -> None:
        e = h.engine
        self.engine = e
        self.admission = Admission(e.max_batch, e.page_size, e.total_pages, e.free_pages())
        self.core = EngineCore(e)
        self._sent: list[AddCommand] = []

    def fits(self, tokens: int, active: int) -> bool:
        return self.admission.fits(tokens, active)

    def send(self, j: EngineJob) -> None:
        self.admission.sent(len(j.input_ids) + j.max_tokens)
        self._sent.append(AddCommand(j, 1))

    def deliver(self, n: int | None = None) -> list:
        n = len(self._sent) if n is None else n
        commands, self._sent = self._sent[:n], self._sent[n:]
        out = self.core.apply(list(commands))
        self.report()
        return out

    def run_to_end(self) -> list:
        out = run_to_end(self.engine)
        self.report()
        return out

    def report(self) -> None:
        self.admission.report(self.engine.free_pages(), self.core.adds)


def test_fits_counts_batch_slots() -> None:
    b = Boundary(make(pages=100, max_batch=2))
    assert b.fits(300, active=1)
    assert not b.fits(300, active=2)


def test_fits_reserves_pages_until_the_engine_reports_the_add() -> None:
    b = Boundary(make(pages=8))
    # 3 pages each (600 tokens): two fit in 8 pages, a third does not, even before any add.
    assert b.fits(600, active=0)
    assert b.fits(600, active=1)
    assert not b.fits(600, active=2)
    b.send(job("a", prompt=500, max_tokens=100))
    b.send(job("b", prompt=500, max_tokens=100))
    assert not b.fits(600, active=2)  # sent, not seen by the engine: still reserved
    b.deliver(1)  # the engine applied "a" only: its pages are in the report, "b"'s reserved
    assert b.admission.free_pages == 5
    assert not b.fits(600, active=2)
    assert b.fits(2 * PAGE, active=2)  # the 2 pages left
    b.deliver()
    assert b.admission.free_pages == 2
    assert not b.fits(PAGE, active=3)  # those 2 are promised to the job just admitted


def test_pages_come_back_when_jobs_finish() -> None:
    b = Boundary(make(pages=4))
    assert b.fits(4 * PAGE, active=0)
    b.send(job("a", prompt=1000, max_tokens=24))
    b.deliver()
    assert not b.fits(PAGE, active=1)
    b.run_to_end()
    assert b.admission.free_pages == 4
    assert b.fits(4 * PAGE, active=0)


def test_a_lapsed_promise_frees_its_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Boundary(make(pages=4))
    assert b.fits(4 * PAGE, active=1)  # admitted, but START refused it: no add
    assert not b.fits(PAGE, active=1)
    later = time.monotonic() + admission.PROMISE_TTL_S + 1
    monkeypatch.setattr(admission.time, "monotonic", lambda: later)
    assert b.fits(PAGE, active=1)  # the unredeemed promise lapsed


def test_a_restarted_engine_owes_no_promise() -> None:
    b = Boundary(make(pages=4))
    assert b.fits(2 * PAGE, active=1)
    b.send(job("a", prompt=500, max_tokens=12))
    assert not b.fits(3 * PAGE, active=1)
    b.admission.restart(free_pages=4)  # the engine process died with "a"; a new one says Hello
    assert b.fits(4 * PAGE, active=1)


def test_job_larger_than_the_whole_cache_fails_with_a_clear_error() -> None:
    b = Boundary(make(pages=4))
    assert b.fits(5 * PAGE, active=0)  # claimed, so that it fails instead of waiting forever
    b.send(job("big", prompt=5 * PAGE - 4, max_tokens=4))
    [refused] = b.deliver()
    assert refused.error is not None
    assert "1280 tokens is over this worker's limit of 1024" in refused.error
    assert b.engine.active() == 0
    with pytest.raises(ValueError, match=r"1280 tokens is over this worker's limit of 1024"):
        b.engine.add(job("big", prompt=5 * PAGE - 4, max_tokens=4))


def test_the_sim_engine_is_limited_by_batch_slots_alone() -> None:
    e = SimEngine(max_batch=2)
    a = Admission(e.max_batch, e.page_size, e.total_pages, e.free_pages())
    assert a.fits(10**6, active=1)
    assert not a.fits(1, active=2)


# ---- results ------------------------------------------------------------------------------


def test_tokens_stream_and_finish_with_length_and_usage() -> None:
    h = make()
    h.engine.add(job("a", prompt=100, max_tokens=3))
    out = run_to_end(h.engine)
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


def test_stop_string_ends_with_stop() -> None:
    h = make(scripts={"a": [100, 101, 102]})
    h.engine.add(job("a", max_tokens=3, stop=["101"]))
    out = run_to_end(h.engine)
    assert "".join(o.text for o in out) == "t100 t"
    assert out[-1].finish_reason == "stop"


def test_stop_conditions_are_eos_plus_the_jobs_own() -> None:
    h = make()
    h.engine.add(job("a", stop=["END"], stop_token_ids=[42]))
    assert set(h.jobs[0].stops) == {EOS_ID, 42, "END"}


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


def test_resumed_job_prefills_sent_tokens_and_generates_the_rest() -> None:
    h = make()
    j = job("a", prompt=10, max_tokens=5)
    j.resume_ids = [500, 501]
    h.engine.add(j)
    assert h.jobs[0].ids[-2:] == [500, 501] and h.jobs[0].max_new == 3
    out = run_to_end(h.engine)
    assert sum(len(o.token_ids) for o in out) == 3
    assert out[-1].prompt_tokens == 10


def test_a_resumed_job_counts_min_tokens_from_its_first_token() -> None:
    h = make()
    for name, sent in (("a", [500, 501]), ("b", [500, 501, 502, 503])):
        j = job(name, prompt=10, max_tokens=8, min_tokens=3)
        j.resume_ids = sent
        h.engine.add(j)
    assert [fake.sampling.min_tokens for fake in h.jobs] == [1, 0]


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
    e.add(job("a", prompt=1000, max_tokens=24))
    e.step()
    assert e.free_pages() == 4
    assert e.cancel("a") is True
    assert h.gens[0].cancelled == ["a"]
    assert e.free_pages() == 8 and e.active() == 0
    assert e.cancel("a") is False
    assert e.cancel("never-seen") is False


def test_cancel_of_a_job_waiting_for_pages() -> None:
    h = make(pages=4)
    e = h.engine
    e.add(job("a", prompt=1000, max_tokens=24))
    e.add(job("b", prompt=1000, max_tokens=24))
    e.step()
    assert [j.identifier for j in h.gens[0].pending_jobs] == ["b"]
    assert e.cancel("b") is True
    assert not h.gens[0].pending_jobs


def test_reset_drops_every_job_and_rebuilds_the_generator() -> None:
    h = make()
    e = h.engine
    e.add(job("a"))
    e.add(job("b"))
    h.gens[0].fail_next = True
    with pytest.raises(RuntimeError):
        e.step()
    assert sorted(e.reset()) == ["a", "b"]
    assert len(h.gens) == 2 and e.active() == 0
    e.add(job("c", max_tokens=2))
    assert run_to_end(e)[-1].finish_reason == "length"


# ---- sampler ------------------------------------------------------------------------------


def test_sampler_fields_are_neutral_by_default() -> None:
    f = sampler_fields(Sampling())
    assert f["temperature"] == 1.0 and f["top_k"] == 0 and f["top_p"] == 1.0
    assert f["min_p"] == 0.0 and f["token_repetition_penalty"] == 1.0
    assert f["token_presence_penalty"] == 0.0 and f["token_frequency_penalty"] == 0.0
    assert f["smoothing_factor"] == 0.0 and f["xtc_probability"] == 0.0
    assert f["dry_multiplier"] == 0.0 and f["mirostat"] is False


def test_temperature_zero_is_greedy() -> None:
    f = sampler_fields(Sampling(temperature=0.0, top_k=40, top_p=0.5))
    assert f["top_k"] == 1 and f["temperature"] == 1.0


def test_sampler_fields_carry_the_request() -> None:
    s = Sampling(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    f = sampler_fields(s)
    assert (f["temperature"], f["top_p"], f["top_k"], f["min_p"]) == (0.7, 0.9, 40, 0.05)
    assert f["token_repetition_penalty"] == 1.1
    assert (f["token_presence_penalty"], f["token_frequency_penalty"]) == (0.5, 0.25)


# ---- cache sizing -------------------------------------------------------------------------


def test_max_seq_len_is_read_as_exllamav2_reads_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = Settings(engine="exllamav2", model_dir=str(tmp_path))
    assert loader.max_seq_len(s) is None  # no config.json
    cfg = tmp_path / "config.json"
    cfg.write_text('{"max_position_embeddings": 8192, "n_positions": 4096}')
    assert loader.max_seq_len(s) == 8192
    cfg.write_text('{"max_sequence_length": 1000, "max_position_embeddings": 8192}')
    assert loader.max_seq_len(s) == 1000  # exllamav2's first key wins
    cfg.write_text("{}")
    assert loader.max_seq_len(s) == loader.EXL2_DEFAULT_MAX_SEQ_LEN
    assert loader.max_seq_len(s.model_copy(update={"max_seq_len": 512})) == 512


def test_default_cache_holds_a_sequence_or_a_slice_per_slot() -> None:
    assert loader.cache_tokens(None, 131_072, 4) == 131_072
    assert loader.cache_tokens(None, 8192, 256) == 256 * backend.DEFAULT_CACHE_TOKENS_PER_JOB
    assert loader.cache_tokens(1000, 8192, 256) == 1024  # the setting, in whole pages
    assert loader.cache_tokens(None, 1000, 256, paged=False) == 1024  # one sequence


def test_the_prefill_chunk_never_exceeds_the_cache() -> None:
    # The GPU benchmark at 1 stream: cache of 768 tokens, chunk 2,048 crashed exllamav2.
    s = loader.forward_sizes(2048, cache_size=768, max_batch=1, max_seq_len=8192)
    assert (s.chunk, s.max_input_len, s.max_batch) == (768, 768, 1)
    # Room enough: the setting, and buffers for a chunk or a decode step of the whole batch.
    s = loader.forward_sizes(2048, cache_size=256 * 1024, max_batch=256, max_seq_len=8192)
    assert (s.chunk, s.max_input_len, s.max_batch) == (2048, 2048, 256)
    s = loader.forward_sizes(512, cache_size=256 * 1024, max_batch=256, max_seq_len=8192)
    assert (s.chunk, s.max_input_len) == (512, 256 * loader.MAX_Q_SIZE)
    # More slots than a cache-sized decode step can carry: the batch is cut to fit.
    s = loader.forward_sizes(2048, cache_size=768, max_batch=256, max_seq_len=8192)
    assert s.max_input_len == 768 and s.max_batch * loader.MAX_Q_SIZE <= 768
    # Nor past the sequence length (exllamav2 cuts its buffers to it at load).
    s = loader.forward_sizes(2048, cache_size=8192, max_batch=4, max_seq_len=1000)
    assert s.chunk == 768 and s.max_input_len == 768
    assert all(x % loader.PAGE_TOKENS == 0 for x in (s.chunk, s.max_input_len))
