"""Constrained jobs on the GPU engines' shared base (worker/dyngen/engine.py, masks.py): the
matcher each job gets at `add` and its replay, the rows a step masks, the masks llguidance
writes for them, the token fed back, and a job whose token its grammar refused. Real
llguidance over the sim engine's tokenizer; the generators are the engines' CPU-test fakes,
whose jobs hand their tokens to the masks (`StepMasks.take`) as genq's job classes do in
`receive_sample`.
The masking on the device needs torch (the last test here, and tests/gpu/)."""

from __future__ import annotations

import ctypes
import random
from types import SimpleNamespace
from typing import Any

import pytest

from shared.constraints import CONSTRAINT_FAILED, grammar_of
from shared.schemas import ModelCard, Sampling
from tests.unit import test_exl2_engine as exl2_fakes
from tests.unit import test_exl3_engine as exl3_fakes
from worker.constraint import Grammars, allowed_ids
from worker.dyngen.backend import Backend
from worker.dyngen.masks import (
    MASKED,
    StepMasks,
    constrained_rows,
    fill_masks,
    mask_words,
)
from worker.engine import EngineJob, JobRefused, StepOutput
from worker.exl2.engine import ExLlamaV2Engine
from worker.exl3.engine import ExLlamaV3Engine
from worker.sim import EOS, build_tokenizer

TOKENIZER = build_tokenizer()
TOKENIZER_JSON = TOKENIZER.to_str()
EOS_ID: int = TOKENIZER.token_to_id(EOS)
LOGITS = TOKENIZER.get_vocab_size() + 100
"""The fake model's logits width: wider than its tokenizer, as real models' often are."""
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tag": {"enum": ["red", "green"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}
GRAMMAR = grammar_of("json_schema", SCHEMA)
DOC = '{"n":42,"tag":"red"}'


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


def piece(token_id: int) -> str:
    return TOKENIZER.decode([token_id])


@pytest.fixture(autouse=True)
def real_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake generators' text from the sim tokenizer's pieces."""
    monkeypatch.setattr(exl2_fakes, "piece", piece)
    monkeypatch.setattr(exl3_fakes, "piece", piece)


class Exl2Generator(exl2_fakes.FakeGenerator):
    """The fake exllamav2 generator with genq's hook installed (`genq_masks`): each job hands
    the token it samples to the masks first (consumed after the step), as
    `gpu_sampling.job_class()` does."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.genq_masks = StepMasks(LOGITS, threads=2)
        self.genq_edits = object()

    def _sample(self, job: Any) -> dict[str, Any]:
        job.new_tokens = job.new
        self.genq_masks.take(job, job.script[job.new])
        return super()._sample(job)


class Exl3Generator(exl3_fakes.FakeGenerator):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.genq_masks = StepMasks(LOGITS, threads=2)
        self.genq_edits = object()

    def _sample(self, job: Any) -> dict[str, Any]:
        job.new_tokens = job.new
        self.genq_masks.take(job, job.script[job.new])
        return super()._sample(job)


CARD = {"name": "fake", "max_seq_len": 4096, "max_batch": 4, "tokenizer_sha": "0"}


def exl2(scripts: dict[str, list[int]] | None = None, hook: bool = True) -> Any:
    jobs: list[Any] = []

    def make_job(i, max_new, sampling, seed, stops, identifier):  # type: ignore[no-untyped-def]
        script = (scripts or {}).get(identifier, [*ids(DOC), EOS_ID])
        jobs.append(exl2_fakes.FakeJob(i, max_new, sampling, seed, stops, identifier, script))
        return jobs[-1]

    gen_cls = Exl2Generator if hook else exl2_fakes.FakeGenerator
    backend = Backend(lambda: gen_cls(64, 4), make_job, piece, vocab_size=LOGITS)
    card = ModelCard(engine="exllamav2", eos_token_ids=[EOS_ID], **CARD)
    return SimpleNamespace(engine=ExLlamaV2Engine(backend, card, TOKENIZER_JSON), jobs=jobs)


def cjob(job_id: str, max_tokens: int = 64, grammar: str | None = GRAMMAR) -> EngineJob:
    return EngineJob(job_id, [5, 6, 7], max_tokens, Sampling(), 7, grammar=grammar)


def run(engine: Any) -> dict[str, list[StepOutput]]:
    return exl3_fakes.by_job(exl3_fakes.run_to_end(engine))


# ---- add: the matcher and its replay ------------------------------------------------------


def test_a_constrained_job_gets_a_matcher_over_the_models_logits_width() -> None:
    h = exl2()
    h.engine.add(cjob("c"))
    h.engine.add(cjob("plain", grammar=None))
    c, plain = h.jobs
    assert plain.__dict__.get("genq_matcher") is None
    mask = c.genq_matcher.allowed_bits()
    assert len(mask) == 4 * mask_words(LOGITS)
    assert allowed_ids(mask, LOGITS) == [ids("{")[0]]  # compact JSON: an object's `{` first


def test_a_resumed_job_replays_what_was_generated_into_its_matcher() -> None:
    h = exl2()
    j = cjob("r")
    j.resume_ids = ids('{"n":42,"tag":"')
    h.engine.add(j)
    allowed = allowed_ids(h.jobs[0].genq_matcher.allowed_bits(), LOGITS)
    texts = {piece(t) for t in allowed}
    assert "red" in texts or "r" in texts
    assert all(("red".startswith(t) or "green".startswith(t)) for t in texts)


def test_a_replay_that_completes_the_grammar_ends_the_job_with_stop() -> None:
    h = exl2()
    j = cjob("done")
    j.resume_ids = ids(DOC)
    h.engine.add(j)
    assert not h.jobs  # nothing enqueued
    [out] = h.engine.step()
    assert (out.job_id, out.finish_reason, out.token_ids) == ("done", "stop", [])


@pytest.mark.parametrize(
    ("grammar", "resume", "why"),
    [
        (GRAMMAR, ids('{"x'), "tokens an earlier attempt generated do not fit the constraint"),
        ("start: %%%", [], "does not build"),
    ],
)
def test_a_job_that_cannot_run_its_constraint_fails_alone_at_add(
    grammar: str, resume: list[int], why: str
) -> None:
    """The job's own fault (`JobRefused` with `constraint_failed`): it fails, not retried."""
    h = exl2()
    h.engine.add(cjob("ok"))
    bad = cjob("bad", grammar=grammar)
    bad.resume_ids = resume
    with pytest.raises(JobRefused, match=why) as refused:
        h.engine.add(bad)
    assert refused.value.code == CONSTRAINT_FAILED
    assert [j.identifier for j in h.jobs] == ["ok"] and h.engine.active() == 1


@pytest.mark.parametrize(
    ("setting", "name"), [({"min_tokens": 4}, "min_tokens"), ({"banned_strings": ["x"]}, "banned")]
)
def test_settings_that_rewind_or_block_eos_are_refused_with_a_constraint(
    setting: dict[str, Any], name: str
) -> None:
    h = exl2()
    j = cjob("c")
    j.sampling = Sampling(**setting)
    with pytest.raises(JobRefused, match=f"{name}.* cannot be combined with a constraint"):
        h.engine.add(j)
    assert not h.jobs
    h.engine.add(EngineJob("plain", [5, 6], 8, Sampling(**setting), 7))  # without: fine
    assert len(h.jobs) == 1


def test_a_generator_without_the_mask_hook_refuses_constrained_jobs() -> None:
    h = exl2(hook=False)
    with pytest.raises(ValueError, match="cannot apply constraints"):
        h.engine.add(cjob("c"))
    h.engine.add(cjob("plain", grammar=None))  # unconstrained jobs still run
    assert h.engine.active() == 1


# ---- steps: tokens into the matcher, a refused token -----------------------------------------


def test_each_token_feeds_the_matcher_and_eos_ends_the_job() -> None:
    h = exl2()
    h.engine.add(cjob("c"))
    out = run(h.engine)["c"]
    assert "".join(o.text for o in out) == DOC and out[-1].finish_reason == "stop"
    m = h.jobs[0].genq_matcher
    assert m.stopped and m.error == ""


def test_max_tokens_cuts_the_json_short_with_length() -> None:
    h = exl2()
    h.engine.add(cjob("c", max_tokens=3))
    out = run(h.engine)["c"]
    assert out[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in out) == 3
    assert not h.jobs[0].genq_matcher.stopped


def test_a_token_the_grammar_refuses_fails_that_job_before_its_output_goes_out() -> None:
    bad = [*ids('{"n":4'), *ids("x"), EOS_ID]
    h = exl2({"bad": bad})
    h.engine.add(cjob("bad"))
    h.engine.add(cjob("good"))
    out = run(h.engine)
    texts = "".join(o.text for o in out["bad"])
    assert '{"n":4' in texts and "x" not in texts
    last = out["bad"][-1]
    assert last.error is not None and "the constraint failed" in last.error
    assert last.error_code == CONSTRAINT_FAILED
    assert "bad" in h.engine._gen.cancelled
    assert "".join(o.text for o in out["good"]) == DOC and out["good"][-1].finish_reason == "stop"
    assert not h.engine._constrained


def test_eos_from_a_matcher_that_failed_fails_the_job_rather_than_ending_it() -> None:
    """A failed matcher's mask is EOS alone, and llguidance takes EOS from it as from a
    complete one: the step that samples it ends the job in the generator, and the job still
    fails (never a `stop` with the output cut short)."""
    h = exl2({"cut": [*ids('{"n":4'), EOS_ID]})
    h.engine.add(cjob("cut"))
    out = run(h.engine)["cut"]
    assert out[-1].finish_reason is None and out[-1].error_code == CONSTRAINT_FAILED
    assert not any(o.finish_reason for o in out) and not h.engine._constrained


def test_a_cancelled_constrained_job_is_forgotten() -> None:
    h = exl2()
    h.engine.add(cjob("c"))
    h.engine.step()
    assert h.engine.cancel("c") and not h.engine._constrained
    assert h.engine.step() == []


def test_the_exllamav3_engine_fails_a_refused_job_by_its_serial() -> None:
    jobs: list[Any] = []
    script = {"bad": [*ids('{"q'), EOS_ID]}

    def make_job(i, max_new, sampling, seed, stops, identifier):  # type: ignore[no-untyped-def]
        s = script.get(identifier, [*ids(DOC), EOS_ID])
        jobs.append(exl3_fakes.FakeJob(i, max_new, sampling, seed, stops, identifier, s))
        return jobs[-1]

    backend = Backend(lambda: Exl3Generator(64, 4), make_job, piece, vocab_size=LOGITS)
    card = ModelCard(engine="exllamav3", eos_token_ids=[EOS_ID], **CARD)
    engine = ExLlamaV3Engine(backend, card, TOKENIZER_JSON)
    engine.add(cjob("bad"))
    engine.add(cjob("good"))
    out = run(engine)
    assert out["bad"][-1].error_code == CONSTRAINT_FAILED
    assert "q" not in "".join(o.text for o in out["bad"])
    assert "".join(o.text for o in out["good"]) == DOC


class HostToken:
    """A one-element tensor on the host, as far as `int()` goes."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


def test_take_skips_healing_steps_and_takes_host_tensors_as_ints() -> None:
    m = Grammars(TOKENIZER_JSON, [EOS_ID]).matcher(GRAMMAR)
    masks = StepMasks(LOGITS, threads=1)
    healing = SimpleNamespace(genq_matcher=m, new_tokens=-1)
    masks.take(healing, ids("x")[0])  # the prompt's last token, rewritten: not output
    job = SimpleNamespace(genq_matcher=m, new_tokens=0)
    masks.take(job, HostToken(ids("{")[0]))
    masks.consume()
    assert not getattr(job, "genq_failed", None) and masks.consumed == 1
    assert allowed_ids(m.allowed_bits(), 10**6) == [ids('"')[0]]


def test_the_steps_tokens_reach_their_matchers_together_after_the_step() -> None:
    """`take` only queues a token; `consume` feeds every queued one to its matcher, marking
    the job whose token its grammar refuses; a job that takes a second token before the first
    was consumed has them consumed in order."""
    g = Grammars(TOKENIZER_JSON, [EOS_ID], LOGITS)
    masks = StepMasks(LOGITS, threads=2)
    jobs = [SimpleNamespace(genq_matcher=g.matcher(GRAMMAR), new_tokens=0) for _ in range(3)]
    brace, quote = ids("{")[0], ids('"')[0]
    masks.take(jobs[0], brace)
    masks.take(jobs[1], HostToken(brace))
    masks.take(jobs[2], ids("x")[0])  # not what the grammar allows first
    assert allowed_ids(jobs[0].genq_matcher.allowed_bits(), LOGITS) == [brace]  # not yet
    masks.consume()
    assert masks.consumed == 3 and masks.profile()["consumed"] == 3
    for j in jobs[:2]:
        assert allowed_ids(j.genq_matcher.allowed_bits(), LOGITS) == [quote]
        assert not getattr(j, "genq_failed", None)
    assert jobs[2].genq_failed.startswith(f"at token {ids('x')[0]}: ")
    masks.take(jobs[0], quote)
    masks.take(jobs[0], ids("n")[0])  # the same job again: its first token goes in first
    masks.consume()
    assert not getattr(jobs[0], "genq_failed", None)
    assert allowed_ids(jobs[0].genq_matcher.allowed_bits(), LOGITS) == [quote]
    masks.take(jobs[2], brace)  # a failed job takes nothing more
    masks.take(SimpleNamespace(genq_matcher=g.matcher(GRAMMAR), new_tokens=-1), brace)  # healing
    masks.consume()
    assert masks.consumed == 5


def test_the_engine_consumes_the_steps_tokens_before_its_outputs_go_out() -> None:
    h = exl2()
    h.engine.add(cjob("c"))
    h.engine.add(cjob("d"))
    h.engine.step()
    masks = h.engine._gen.genq_masks
    assert masks.consumed == 2 and not masks._taken
    assert all(not j.genq_matcher.accepting for j in h.jobs)
    assert h.engine.profile()["consumed"] == 2


# ---- a step's rows and masks --------------------------------------------------------------


def row_job(matcher: Any = None, done: bool = True, sequences: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        genq_matcher=matcher, is_prefill_done=lambda: done, sequences=[object()] * sequences
    )


def test_the_rows_masked_are_the_constrained_jobs_in_the_generators_order() -> None:
    a, b = object(), object()
    jobs = [row_job(a), row_job(), row_job(None, done=False), row_job(sequences=2), row_job(b)]
    plan = constrained_rows(jobs)
    assert (plan.rows, plan.matchers, plan.total_rows) == ([0, 4], [a, b], 5)
    assert constrained_rows([row_job(), row_job()]).rows == []


def test_llguidance_writes_each_rows_mask_where_the_step_reads_it() -> None:
    import llguidance

    g = Grammars(TOKENIZER_JSON, [EOS_ID], LOGITS)
    words = mask_words(LOGITS)
    object_start = g.matcher(GRAMMAR)
    in_enum = g.matcher(GRAMMAR, ids('{"n":1,"tag":"gr'))
    number = g.matcher(grammar_of("regex", "[0-9]{2,4}"), ids("12"))
    matchers = [object_start, in_enum, number]
    buf = (ctypes.c_int32 * (words * 4))()
    fill_masks(llguidance.LLExecutor(2), matchers, ctypes.addressof(buf), words, 4)
    raw = bytes(buf)
    rows = [raw[i * words * 4 : (i + 1) * words * 4] for i in range(3)]
    assert rows == [m.allowed_bits() for m in matchers]
    assert EOS_ID in allowed_ids(rows[2], LOGITS)  # "12" may end; EOS is allowed there
    assert EOS_ID not in allowed_ids(rows[1], LOGITS)
    assert buf[3 * words :] == [0] * words  # the row no matcher was given: untouched


def test_masks_applied_to_logits_leave_only_allowed_tokens() -> None:
    """StepMasks on CPU tensors (torch: skipped in CI, run on the GPU machine): constrained
    rows get MASKED wherever their grammar refuses a token, the ids past the matchers'
    vocabulary too; the unconstrained row is untouched."""
    torch = pytest.importorskip("torch")
    g = Grammars(TOKENIZER_JSON, [EOS_ID], LOGITS)
    width = LOGITS + 40  # wider still: the columns beyond the masks' words are blocked
    logits = torch.randn((3, 1, width), generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    jobs = [row_job(g.matcher(GRAMMAR)), row_job(), row_job(g.matcher(GRAMMAR, ids('{"n":')))]
    masks = StepMasks(LOGITS, threads=2)
    masks.apply(logits, jobs)
    assert torch.equal(logits[1], before[1])
    for row, job in ((0, jobs[0]), (2, jobs[2])):
        allowed = allowed_ids(job.genq_matcher.allowed_bits(), LOGITS)
        kept = (logits[row, 0] != MASKED).nonzero().flatten().tolist()
        assert kept == allowed
        assert torch.equal(logits[row, 0, allowed], before[row, 0, allowed])
    assert masks.masked_rows == 2 and masks.steps == 1
    rng = random.Random(3)
    every = [row_job(g.matcher(GRAMMAR, ids(DOC[: rng.randint(0, 10)]))) for _ in range(4)]
    full = torch.zeros((4, 1, LOGITS))
    masks.apply(full, every)  # every row constrained: masked in place without an index
    for row, job in enumerate(every):
        kept = (full[row, 0] == 0).nonzero().flatten().tolist()
        assert kept == allowed_ids(job.genq_matcher.allowed_bits(), LOGITS)


def test_the_benchmark_schema_compiles() -> None:
    from genq.benchgpu import BENCH_SCHEMA

    assert len(BENCH_SCHEMA["properties"]) == 10
    g = Grammars(TOKENIZER_JSON, [EOS_ID])
    assert not g.matcher(grammar_of("json_schema", BENCH_SCHEMA)).error


def test_masks_started_before_the_pass_are_the_ones_applied() -> None:
    """`StepMasks.start` computes a step's masks while the forward pass runs; `apply` takes
    them when the step's rows are the same, and computes them itself when they are not."""
    torch = pytest.importorskip("torch")
    g = Grammars(TOKENIZER_JSON, [EOS_ID], LOGITS)
    jobs = [row_job(g.matcher(GRAMMAR)), row_job(), row_job(g.matcher(GRAMMAR, ids('{"n":')))]
    masks = StepMasks(LOGITS, threads=2)
    masks.start(jobs)  # no buffers yet: nothing started, apply computes
    masks.apply(torch.zeros((3, 1, LOGITS)), jobs)
    assert masks.prefetched == 0
    for job, text in ((jobs[0], '{"'), (jobs[2], "1")):
        for t in ids(text):
            assert job.genq_matcher.consume(t)
    masks.start(jobs)
    ahead = torch.zeros((3, 1, LOGITS))
    masks.apply(ahead, jobs)
    assert masks.prefetched == 1
    for row, job in ((0, jobs[0]), (2, jobs[2])):
        kept = (ahead[row, 0] == 0).nonzero().flatten().tolist()
        assert kept == allowed_ids(job.genq_matcher.allowed_bits(), LOGITS)
    other = [row_job(g.matcher(GRAMMAR, ids('{"n":12')))]
    masks.start(jobs)  # started for other rows than the step's: not taken
    mine = torch.zeros((1, 1, LOGITS))
    masks.apply(mine, other)
    assert masks.prefetched == 1
    kept = (mine[0, 0] == 0).nonzero().flatten().tolist()
    assert kept == allowed_ids(other[0].genq_matcher.allowed_bits(), LOGITS)
    masks.close()
