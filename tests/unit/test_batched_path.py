"""The guard of genq's batched sampling pass on the GPU engines: no request field may take a job
off it (onto the library's per-job sampler, which halves a full batch's throughput) unless the
engine's `SamplingSupport.per_job` says so, with why, and docs/performance.md names its cost.

Each field, set off its default alone, goes through the engine's real `add` (the dynamic
engines' `DynamicEngine.add`: what it hands the library and what genq's hook applies itself)
and the engine's real job factory (exllamav2's `loader.job_factory`, exllamav3's), over
stand-ins for the library's job and sampler classes; then the engine's own decision code says
whether the job is on the pass: exllamav2's `gpu_sampling.job_params` (as its job class calls
it), exllamav3's `batch_sampling.row_params` (the job factory's `genq_params`). A new setting
of `Sampling` is checked here as soon as tests/unit/test_sampling_support.py gives it a probe."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shared.constraints import grammar_of
from shared.schemas import SAMPLING_FIELDS, ModelCard, Sampling
from tests.unit.test_exl3_engine import FakeComboSampler, FakeExl3Job
from tests.unit.test_sampling_support import PROBES, probe
from worker.dyngen.backend import Backend
from worker.dyngen.edits import StepEdits, edit_rows
from worker.dyngen.engine import DynamicEngine
from worker.dyngen.masks import StepMasks
from worker.engine import EngineJob, SamplingSupport
from worker.exl2 import gpu_sampling
from worker.exl2 import loader as exl2_loader
from worker.exl2.engine import ExLlamaV2Engine
from worker.exl3 import loader as exl3_loader
from worker.exl3.engine import ExLlamaV3Engine
from worker.sim import EOS, build_tokenizer

TOKENIZER = build_tokenizer()
EOS_ID: int = TOKENIZER.token_to_id(EOS)
VOCAB = TOKENIZER.get_vocab_size() + 32
DOCS = Path(__file__).resolve().parents[2] / "docs" / "performance.md"


class StandInExl2Job:
    """`ExLlamaV2DynamicJob`'s constructor as exllamav2 0.3 has it (what it sets that
    `job_params` reads), and genq's job class's one line (`genq_params`)."""

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        max_skips: int | None = 4,
        gen_settings: Any = None,
        seed: int | None = None,
        stop_conditions: Any = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        return_probs: bool = False,
        filters: Any = None,
        filter_prefer_eos: bool = False,
        token_healing: bool = False,
        identifier: object | None = None,
        banned_strings: list[str] | None = None,
        embeddings: Any = None,
    ) -> None:
        self.sequences = [input_ids]
        self.prefix_token = object() if token_healing else None
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.new_tokens = 0 if self.prefix_token is None else -1
        self.gen_settings = gen_settings
        self.return_top_tokens = return_top_tokens
        self.return_logits = return_logits
        self.return_probs = return_probs
        self.filters = filters if filters is not None else []
        self.banned_strings = [s.lower() for s in banned_strings] if banned_strings else []
        self.stop_conditions = stop_conditions
        self.checkpoint = None
        self.genq_params = gpu_sampling.job_params(self)  # as gpu_sampling.job_class() does


def exl2_settings(**fields: Any) -> SimpleNamespace:
    """`ExLlamaV2Sampler.Settings(**fields)`: every field genq sets, no sampling hooks."""
    return SimpleNamespace(post_sampling_hooks=[], **fields)


class HookedGenerator:
    """Either library's generator as `DynamicEngine.add` sees it, with genq's hook installed
    (its edits and masks): what `add` reads, and the jobs enqueued."""

    page_size = 256
    max_pages = 64
    max_seq_len = 8192
    max_batch_size = 8

    def __init__(self) -> None:
        self.pagetable = SimpleNamespace(max_pages=self.max_pages)
        self.pending_jobs: list[Any] = []
        self.genq_edits = StepEdits()
        self.genq_masks = StepMasks(VOCAB, threads=1)

    def enqueue(self, job: Any) -> int:
        self.pending_jobs.append(job)
        return len(self.pending_jobs) - 1


def exl2_engine() -> ExLlamaV2Engine:
    make_job = exl2_loader.job_factory(
        StandInExl2Job, exl2_settings, lambda ids: ids, lambda bias: ("token_bias", bias)
    )
    backend = Backend(HookedGenerator, make_job, str, vocab_size=VOCAB)
    card = ModelCard(name="m", engine="exllamav2", max_seq_len=8192, max_batch=8,
                     tokenizer_sha="0", eos_token_ids=[EOS_ID])  # fmt: skip
    return ExLlamaV2Engine(backend, card, TOKENIZER.to_str())


def exl3_engine() -> ExLlamaV3Engine:
    make_job = exl3_loader.job_factory(FakeExl3Job, FakeComboSampler, lambda ids: ids, True)
    backend = Backend(HookedGenerator, make_job, str, vocab_size=VOCAB)
    card = ModelCard(name="m", engine="exllamav3", max_seq_len=8192, max_batch=8,
                     tokenizer_sha="0", eos_token_ids=[EOS_ID])  # fmt: skip
    return ExLlamaV3Engine(backend, card, TOKENIZER.to_str())


ENGINES: dict[str, tuple[Callable[[], DynamicEngine], Callable[[Any], bool]]] = {
    "exllamav2": (exl2_engine, lambda job: gpu_sampling.job_params(job) is not None),
    "exllamav3": (exl3_engine, lambda job: job.genq_params is not None),
}
"""Each GPU engine, and its own answer to: is this library job sampled on the batched pass?"""

CONSTRAINT = "constraint"
"""A job under a JSON schema (`EngineJob.grammar`), beside the sampler settings."""


def added(engine_name: str, job: EngineJob) -> tuple[Any, bool, SamplingSupport]:
    """The library job `add` enqueued for `job`, whether the engine samples it on the batched
    pass, and the engine's table."""
    make_engine, on_pass = ENGINES[engine_name]
    engine = make_engine()
    engine.add(job)
    [handle] = engine._gen.pending_jobs
    return handle, on_pass(handle), type(engine).sampling_support


@pytest.mark.parametrize("field", [*SAMPLING_FIELDS, CONSTRAINT])
@pytest.mark.parametrize("engine_name", ENGINES)
def test_no_request_field_takes_a_job_off_the_batched_pass_unless_the_table_says_so(
    engine_name: str, field: str
) -> None:
    grammar = grammar_of("json_schema", {"type": "object"}) if field == CONSTRAINT else None
    sampling = Sampling() if field == CONSTRAINT else probe(field)
    job = EngineJob("j", [5, 6, 7], 8, sampling, 1, grammar=grammar)
    _, on_pass, support = added(engine_name, job)
    if field in support.per_job:
        assert not on_pass, (
            f"{field} no longer leaves {engine_name}'s batched pass: take it out of "
            "SamplingSupport.per_job (and its cost out of docs/performance.md)"
        )
    else:
        assert on_pass, (
            f"{field} sends a job off {engine_name}'s batched sampling pass, onto the library's "
            "per-job sampler: apply it in genq's hook (worker/dyngen), or name it in the "
            "engine's SamplingSupport.per_job with why, and its cost in docs/performance.md"
        )


@pytest.mark.parametrize("engine_name", ENGINES)
def test_genqs_hook_takes_the_bias_and_the_minimum_and_the_library_gets_neither(
    engine_name: str,
) -> None:
    bias = {"7": 2.5, "5": -100.0, str(VOCAB + 1): 1.0}
    s = Sampling(min_tokens=3, logit_bias=bias, stop_token_ids=[9])
    handle, on_pass, _ = added(engine_name, EngineJob("j", [5, 6], 8, s, 1))
    assert on_pass
    assert handle.genq_bias == ([5, 7], [-100.0, 2.5])  # an id past the model's: dropped
    assert (handle.genq_min_tokens, handle.genq_stop_ids) == (3, sorted([EOS_ID, 9]))
    assert handle.min_new_tokens == 0
    if engine_name == "exllamav2":
        assert handle.gen_settings.token_bias is None
    else:
        assert handle.sampler.args["logit_bias"] is None


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_resumed_jobs_minimum_counts_what_was_sent(engine_name: str) -> None:
    j = EngineJob("j", [5, 6], 8, Sampling(min_tokens=5), 1, resume_ids=[11, 12])
    handle, _, _ = added(engine_name, j)
    assert handle.genq_min_tokens == 3


def test_a_generator_without_the_hook_hands_the_library_the_bias_and_the_minimum() -> None:
    """Without genq's hook (an exllamav2 that lacks what it relies on) the library honours
    both, as before: per job."""

    class Bare(HookedGenerator):
        def __init__(self) -> None:
            super().__init__()
            del self.genq_edits

    engine = exl2_engine()
    engine._gen = Bare()
    engine.add(EngineJob("j", [5, 6], 8, Sampling(min_tokens=3, logit_bias={"5": 1.0}), 1))
    [handle] = engine._gen.pending_jobs
    assert handle.min_new_tokens == 3
    assert handle.gen_settings.token_bias == ("token_bias", {"5": 1.0})
    assert getattr(handle, "genq_min_tokens", 0) == 0 and handle.genq_params is None


def test_the_edited_rows_follow_the_generators_order_and_the_minimum() -> None:
    def job(new: int, minimum: int = 0, bias: bool = False, done: bool = True, seqs: int = 1):  # type: ignore[no-untyped-def]
        return SimpleNamespace(
            new_tokens=new,
            genq_min_tokens=minimum,
            genq_bias=([1], [1.0]) if bias else None,
            is_prefill_done=lambda: done,
            sequences=[0] * seqs,
        )

    jobs = [job(0, 2), job(2, 2), job(0, 3, done=False), job(1, seqs=2, bias=True), job(1, 4, True)]
    plan = edit_rows(jobs)
    assert [r for r, _ in plan.blocked] == [0, 4] and [r for r, _ in plan.bias] == [2, 4]
    assert plan.total_rows == 5
    assert not edit_rows([job(3, 3), job(0)])  # nothing to edit: the step costs one walk


def test_each_setting_that_leaves_the_pass_has_its_cost_in_the_performance_page() -> None:
    """docs/performance.md's table of the settings that leave the batched pass names every
    engine's `per_job` settings, and no others."""
    text = DOCS.read_text()
    start = text.index("<!-- per-job table -->")
    table = text[start : text.index("<!-- /per-job table -->")]
    for engine_name, (make_engine, _) in ENGINES.items():
        support = type(make_engine()).sampling_support
        rows = re.findall(rf"^\| {engine_name} \| `(\w+)`", table, flags=re.M)
        assert sorted(rows) == sorted(support.per_job), engine_name


def test_the_probes_cover_every_setting() -> None:
    assert set(PROBES) == set(SAMPLING_FIELDS)


def test_the_edits_on_the_logits() -> None:
    """StepEdits on CPU tensors (torch: skipped in CI, run on the GPU machine): the biased
    rows get their biases, the rows short of their minimum get MASKED at their stop tokens,
    in one write each; a row at its minimum and the other rows are untouched."""
    torch = pytest.importorskip("torch")
    from worker.dyngen.masks import MASKED

    def job(new: int, minimum: int = 0, bias: tuple[list[int], list[float]] | None = None) -> Any:
        return SimpleNamespace(
            new_tokens=new,
            genq_min_tokens=minimum,
            genq_stop_ids=[2, 9, 40],  # 40: past the logits' width, dropped
            genq_bias=bias,
            is_prefill_done=lambda: True,
            sequences=[0],
        )

    jobs = [job(0, 2), job(0), job(1, 2, ([3, 4], [1.5, -100.0])), job(2, 2, ([3], [0.5]))]
    logits = torch.randn((4, 1, 12), generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    edits = StepEdits()
    edits.apply(logits, jobs)
    expect = before.clone()
    expect[0, 0, [2, 9]] = MASKED
    expect[2, 0, [2, 9]] = MASKED
    expect[2, 0, 3] += 1.5
    expect[2, 0, 4] += -100.0
    expect[3, 0, 3] += 0.5
    assert torch.equal(logits, expect)
    assert (edits.steps, edits.biased_rows, edits.blocked_rows) == (1, 2, 2)
    edits.apply(torch.zeros((3, 1, 12)), jobs)  # rows not the plan's: left alone, counted
    assert edits.missed == 1
    half = torch.zeros((4, 1, 12), dtype=torch.float16)
    edits.apply(half, jobs)
    assert half[0, 0, 2] == MASKED and half[2, 0, 3] == 1.5
