"""GPU sampling (worker/exl2/gpu_sampling.py): which jobs it serves, which rows of a step are
theirs.

Plain Python against stand-ins with the attributes of exllamav2's job and sampler settings; the
sampling itself runs on the GPU (tests/gpu/test_sampling_gpu.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from shared.schemas import Sampling
from worker.dyngen.batch_pass import RowParams
from worker.exl2.gpu_sampling import job_params, plan
from worker.exl2.loader import sampler_fields


def settings(**fields: Any) -> SimpleNamespace:
    """exllamav2 Settings as genq's engine fills them (every field explicit)."""
    return SimpleNamespace(**{**sampler_fields(Sampling()), "post_sampling_hooks": [], **fields})


def job(seed: int = 0, prefill_done: bool = True, **attrs: Any) -> SimpleNamespace:
    base = {
        "sequences": [object()],
        "filters": [],
        "prefix_token": None,
        "return_top_tokens": 0,
        "return_logits": False,
        "banned_strings": [],
        "min_new_tokens": 0,
        "gen_settings": settings(),
        "checkpoint": None,
        "new_tokens": 0,
        "rng": random.Random(seed),
        "is_prefill_done": lambda: prefill_done,
    }
    j = SimpleNamespace(**{**base, **attrs})
    j.genq_params = job_params(j)
    return j


def test_genqs_default_sampling_is_served_on_the_gpu() -> None:
    assert job_params(job()) == RowParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


@pytest.mark.parametrize(
    ("sampling", "expect"),
    [
        (Sampling(temperature=0.0), RowParams(1.0, 1, 1.0, 0.0)),
        (Sampling(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05), RowParams(0.7, 40, 0.9, 0.05)),
        (Sampling(logprobs=0), RowParams(1.0, 0, 1.0, 0.0)),
    ],
)
def test_temperature_top_k_top_p_min_p_are_served(sampling: Sampling, expect: RowParams) -> None:
    assert job_params(job(gen_settings=settings(**sampler_fields(sampling)))) == expect


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(repetition_penalty=1.1),
        Sampling(presence_penalty=0.5),
        Sampling(frequency_penalty=-0.5),
    ],
)
def test_penalties_stay_on_the_cpu_sampler(sampling: Sampling) -> None:
    assert job_params(job(gen_settings=settings(**sampler_fields(sampling)))) is None


@pytest.mark.parametrize(
    "attrs",
    [
        {"return_top_tokens": 3},
        {"filters": [object()]},
        {"prefix_token": object()},
        {"return_logits": True},
        {"banned_strings": ["no"]},
        {"min_new_tokens": 4},
        {"sequences": [object(), object()]},  # CFG: two sequences sampled together
        {"gen_settings": settings(mirostat=True)},
        {"gen_settings": settings(dry_multiplier=0.8)},
        {"gen_settings": settings(token_bias=object())},
        {"gen_settings": settings(post_sampling_hooks=[object()])},
    ],
)
def test_anything_else_stays_on_the_cpu_sampler(attrs: dict[str, Any]) -> None:
    assert job_params(job(**attrs)) is None


def test_greedy_and_truncation_are_told_apart() -> None:
    assert RowParams(0.0, 0, 1.0, 0.0).greedy and RowParams(1.0, 1, 1.0, 0.0).greedy
    assert not RowParams(1.0, 0, 1.0, 0.0).truncates
    assert not RowParams(1.0, 1, 0.5, 0.0).truncates  # greedy: nothing to truncate
    assert RowParams(1.0, 5, 1.0, 0.0).truncates
    assert RowParams(1.0, 0, 0.9, 0.0).truncates
    assert RowParams(1.0, 0, 1.0, 0.1).truncates


def test_plan_follows_the_generators_row_order() -> None:
    """Rows are the active jobs whose prefill is done, in order; a job still prefilling has
    none; a CPU-sampled job keeps its row but is not planned."""
    gpu_a, prefilling, cpu, gpu_b = (
        job(seed=1),
        job(seed=2, prefill_done=False),
        job(seed=3, return_top_tokens=2),
        job(seed=4, gen_settings=settings(temperature=0.5, top_k=8)),
    )
    p = plan([gpu_a, prefilling, cpu, gpu_b])
    assert p.total_rows == 3
    assert p.rows == [0, 2]
    assert p.jobs == [gpu_a, gpu_b]
    assert not p.every_row
    assert p.truncates  # gpu_b's top_k
    # Each planned job's draw came from its own RNG, as the CPU sampler would have drawn it.
    assert [row[4] for row in p.params] == [random.Random(1).random(), random.Random(4).random()]
    assert p.params[1][:4] == (0.5, 8, 1.0, 0.0)
    # The CPU-sampled job's RNG is untouched: its sampler draws from it itself.
    assert cpu.rng.random() == random.Random(3).random()


def test_a_step_of_gpu_jobs_only_covers_every_row() -> None:
    p = plan([job(seed=i) for i in range(5)])
    assert p.every_row and p.rows == [0, 1, 2, 3, 4] and not p.truncates


def test_a_job_with_a_checkpoint_goes_to_the_cpu_sampler_for_that_step() -> None:
    j = job()
    j.checkpoint = {"offset": 0, "explored_tokens": [5]}
    assert plan([j]).rows == []
