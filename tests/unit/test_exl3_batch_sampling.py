"""Batched sampling for exllamav3 (worker/exl3/batch_sampling.py): which jobs it serves, which
rows of a decode pass are theirs, the hand-off of each token to its job, and (where torch is
installed: the GPU machine, not CI) the hook itself on a stand-in generator on the CPU.

The sampling pass is both engines' (worker/dyngen/batch_pass.py `pick_on_device`), whose
distributions are checked on the GPU (tests/gpu/test_sampling_gpu.py); the real generator in
tests/gpu/test_exl3_gpu.py."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from shared.schemas import Sampling
from worker.dyngen.batch_pass import RowParams
from worker.exl3.batch_sampling import install, plan, row_params, serves_at_least, take


def job(seed: int = 0, prefill_done: bool = True, **attrs: Any) -> SimpleNamespace:
    """The attributes of an exllamav3 `Job` the plan reads, one sampled token in."""
    base = {
        "sequences": [object()],
        "new_tokens": 1,
        "forced_ids": None,
        "filters": [],
        "rng": random.Random(seed),
        "is_prefill_done": lambda: prefill_done,
        "genq_params": row_params(Sampling()),
        "genq_next": None,
    }
    return SimpleNamespace(**{**base, **attrs})


def test_genqs_default_sampling_and_its_truncations_are_batched() -> None:
    assert row_params(Sampling()) == RowParams(1.0, 0, 1.0, 0.0)
    s = Sampling(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05)
    assert row_params(s) == RowParams(0.7, 40, 0.9, 0.05)
    assert row_params(Sampling(temperature=0.0)).greedy  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(repetition_penalty=1.1),
        Sampling(presence_penalty=0.5),
        Sampling(frequency_penalty=-0.5),
        Sampling(logprobs=0),
        Sampling(logprobs=5),
    ],
)
def test_penalties_and_logprobs_stay_on_exllamav3s_sampler(sampling: Sampling) -> None:
    assert row_params(sampling) is None


def test_the_plan_follows_the_generators_row_order() -> None:
    """Rows as iterate_gen stacks them: a job still in prefill has none; a job with two
    sequences has two; jobs the pass does not serve keep their rows."""
    jobs = [
        job(1),
        job(prefill_done=False),
        job(genq_params=None),  # penalties: its own sampler
        job(2, sequences=[object(), object()]),  # two rows, its own sampler
        job(3),
    ]
    p = plan(jobs)
    assert p.rows == [0, 4]
    assert p.jobs == [jobs[0], jobs[4]]
    assert p.total_rows == 5 and not p.every_row


def test_each_sampled_job_draws_from_its_own_seeded_rng() -> None:
    jobs = [job(seed) for seed in (11, 12)]
    p = plan(jobs)
    assert [d[-1] for d in p.params] == [random.Random(11).random(), random.Random(12).random()]
    assert p.every_row and not p.truncates


def test_a_truncating_job_turns_the_truncation_on() -> None:
    p = plan([job(), job(genq_params=row_params(Sampling(top_p=0.9)))])
    assert p.truncates
    assert p.params[1][:4] == (1.0, 0, 0.9, 0.0)


@pytest.mark.parametrize(
    "attrs",
    [
        {"new_tokens": 0},  # its first token: exllamav3 checks those logits for NaN/inf
        {"new_tokens": -1},  # token healing
        {"forced_ids": [5]},
        {"filters": [object()]},
    ],
)
def test_jobs_the_pass_must_not_sample_keep_their_own_sampler(attrs: dict[str, Any]) -> None:
    j = job(**attrs)
    p = plan([j])
    assert p.jobs == [] and p.total_rows == 1
    assert j.rng.random() == random.Random(0).random(), "its RNG was not drawn from"


def test_a_job_takes_only_the_token_of_the_current_pass() -> None:
    sampler = SimpleNamespace(step=7)
    j = job(generator=SimpleNamespace(genq_sampler=sampler), genq_next=(7, "token"))
    assert take(j) == "token"
    assert j.genq_next is None
    assert take(j) is None  # nothing handed over: its own sampler
    j.genq_next = (6, "stale")
    assert take(j) is None and j.genq_next is None
    j.genq_next = (7, "token")
    j.generator = SimpleNamespace()  # a generator without the hook
    assert take(j) is None


def test_install_refuses_a_generator_without_what_the_hook_reads() -> None:
    gen = SimpleNamespace(active_jobs=[], model=object())
    assert install(gen) is None
    assert not hasattr(gen, "genq_sampler")


def test_a_pass_serving_fewer_jobs_than_the_threshold_leaves_each_to_its_own_sampler() -> None:
    """Below `min_jobs` (GENQ_BATCHED_SAMPLING_MIN_JOBS) the pass launches nothing: every job
    samples itself, and no token of an earlier pass is handed on."""
    logits = SimpleNamespace(shape=(2, 1, 4), dim=lambda: 3, is_cuda=False)  # no torch needed
    jobs = [job(seed=1), job(seed=2)]
    gen = stand_in_generator(jobs, logits, 4)
    sampler = install(gen, min_jobs=3)
    assert sampler is not None and sampler.min_jobs == 3
    gen.model.forward(input_ids=None, params={"pinned_staging": True})
    assert sampler.step == 1 and sampler.batched_tokens == 0
    assert all(take(j) is None for j in jobs)
    # their RNGs untouched: exllamav3's own sampler draws the same numbers as with the pass off
    assert [j.rng.random() for j in jobs] == [random.Random(s).random() for s in (1, 2)]


@pytest.mark.parametrize(
    ("attrs", "counts"),
    [
        ({}, True),
        ({"genq_params": None}, False),  # penalties or logprobs: exllamav3's sampler
        ({"prefill_done": False}, False),
        ({"new_tokens": 0}, False),  # its first token
    ],
)
def test_the_threshold_counts_the_jobs_the_pass_would_sample(
    attrs: dict[str, Any], counts: bool
) -> None:
    jobs = [job(), job(**attrs)]
    assert serves_at_least(jobs, 2) is counts
    assert serves_at_least(jobs, 1) and not serves_at_least(jobs, 3)
    assert jobs[0].rng.random() == random.Random(0).random()  # nothing drawn


# ---- the hook on a stand-in generator (needs torch: skipped in CI) -----------------------------


class StandInModel:
    """exllamav3's model as the generator calls it: `forward(input_ids=, params=)` → logits
    (rows, 1, padded vocabulary); here a fixed tensor."""

    def __init__(self, logits: Any) -> None:
        self.logits = logits
        self.caps: dict[str, Any] = {}

    def forward(self, input_ids: Any = None, params: Any = None) -> Any:
        return self.logits


def stand_in_generator(jobs: list[Any], logits: Any, vocab: int) -> SimpleNamespace:
    gen = SimpleNamespace(
        active_jobs=jobs,
        model=StandInModel(logits),
        tokenizer=SimpleNamespace(actual_vocab_size=vocab),
        max_batch_size=8,
    )
    for j in jobs:
        j.generator = gen
    return gen


def test_one_pass_hands_each_served_job_its_token() -> None:
    torch = pytest.importorskip("torch")
    vocab = 6
    logits = torch.full((3, 1, 8), -5.0)
    logits[0, 0, 4] = 9.0
    logits[1, 0, 1] = 9.0
    logits[2, 0, 2] = 9.0
    logits[:, 0, 6:] = 50.0  # the padded vocabulary, beyond the tokenizer's: never a token
    greedy = row_params(Sampling(temperature=0.0))
    jobs = [job(genq_params=greedy), job(genq_params=None), job(genq_params=greedy)]
    gen = stand_in_generator(jobs, logits, vocab)
    sampler = install(gen, min_jobs=2)  # the two it serves: at the threshold, the pass runs
    assert sampler is not None and gen.genq_sampler is sampler

    gen.model.forward(input_ids=None, params={"pinned_staging": True})

    assert sampler.batched_tokens == 2
    assert [int(take(j)) for j in (jobs[0], jobs[2])] == [4, 2]
    assert take(jobs[1]) is None
    assert gen.model.caps == {}  # everything else reaches the model itself


def test_a_pass_other_than_the_decode_step_samples_nothing() -> None:
    torch = pytest.importorskip("torch")
    jobs = [job()]
    gen = stand_in_generator(jobs, torch.zeros((1, 1, 4)), 4)
    sampler = install(gen)
    assert sampler is not None
    gen.model.forward(input_ids=None, params={"last_tokens_only": 1})  # an MTP prefill
    assert sampler.step == 0 and jobs[0].genq_next is None


def test_rows_that_do_not_match_the_logits_are_left_to_the_jobs() -> None:
    """A pass whose row count is not the plan's (a generator that stacks rows otherwise) is
    not guessed at: every job samples itself."""
    torch = pytest.importorskip("torch")
    jobs = [job(), job()]
    gen = stand_in_generator(jobs, torch.zeros((3, 1, 4)), 4)
    sampler = install(gen)
    assert sampler is not None
    gen.model.forward(input_ids=None, params={"pinned_staging": True})
    assert sampler.batched_tokens == 0 and all(j.genq_next is None for j in jobs)


def test_seeded_draws_follow_the_distribution() -> None:
    """Temperature 1 over two tokens of probability 0.25 and 0.75: the draws (one per job and
    pass, from the job's RNG) land in proportion."""
    torch = pytest.importorskip("torch")
    logits = torch.tensor([[[0.0, float(torch.log(torch.tensor(3.0)))]]])
    jobs = [job(seed=5)]
    gen = stand_in_generator(jobs, logits, 2)
    install(gen, min_jobs=1)
    ones = 0
    for _ in range(2000):
        gen.model.forward(input_ids=None, params={"pinned_staging": True})
        ones += int(take(jobs[0]))
    assert 0.72 < ones / 2000 < 0.78


def test_the_masks_of_a_decode_pass_start_before_it_and_are_applied_after_it() -> None:
    """exllamav3's decode pass: genq's hook starts the constrained rows' masks (on their
    thread) before the model's forward, then edits and masks the logits it returns."""
    events: list[str] = []

    class Recorder:
        def start(self, jobs: Any) -> None:
            events.append("start")

        def apply(self, logits: Any, jobs: Any) -> None:
            events.append("apply")

    class Model(StandInModel):
        def forward(self, input_ids: Any = None, params: Any = None) -> Any:
            events.append("forward")
            return self.logits

    logits = SimpleNamespace(dim=lambda: 3, shape=(0, 1, 4))
    gen = stand_in_generator([], logits, 4)
    gen.model = Model(logits)
    sampler = install(gen)
    assert sampler is not None and gen.genq_edits is sampler.edits
    sampler.masks = Recorder()  # type: ignore[assignment]
    gen.model.forward(input_ids=None, params={"pinned_staging": True})
    assert events == ["start", "forward", "apply"]
    events.clear()
    gen.model.forward(input_ids=None, params={"last_tokens_only": 1})  # not a decode pass
    assert events == ["forward"]
