"""Sampling on the GPU (worker/exl2/gpu_sampling.py): the same distributions as exllamav2's CPU
sampler, and the engine taking it for what it can serve and the CPU sampler for the rest."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from shared.schemas import Sampling
from shared.settings import Settings
from tests.gpu.conftest import TEST_BATCH, TEST_CACHE_TOKENS, drive
from tests.gpu.test_exl2_gpu import ejob, prompt
from worker.exl2.gpu_sampling import sample_on_device
from worker.exl2.loader import sampler_fields

pytestmark = pytest.mark.gpu
DRAWS = 20_000


def peaked_logits(vocab: int, seed: int) -> Any:
    """A distribution of a real model's shape: a few likely tokens, a long flat tail."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 1.5
    x[torch.randperm(vocab, generator=g)[:12]] += torch.linspace(4.0, 9.0, 12)
    return x


def gpu_histogram(logits: Any, params: tuple[float, int, float, float], truncates: bool) -> Any:
    import torch

    rng = random.Random(11)
    rows = logits.cuda().half()[None, :].expand(DRAWS, -1)
    picked = sample_on_device(rows, [(*params, rng.random()) for _ in range(DRAWS)], truncates)
    tokens = picked[:, 0].long()
    return torch.bincount(tokens, minlength=logits.shape[0]).double() / DRAWS, picked


def cpu_histogram(logits: Any, sampling: Sampling) -> Any:
    """exllamav2's own CPU sampler on the same (fp16-rounded) logits."""
    import torch
    from exllamav2.generator import ExLlamaV2Sampler

    vocab = logits.shape[0]
    settings = ExLlamaV2Sampler.Settings(**sampler_fields(sampling))
    tokenizer = SimpleNamespace(get_vocab_size=lambda: vocab)
    rows = logits.half().float()[None, None, :]
    rng = random.Random(12)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(DRAWS):
        token, *_ = ExLlamaV2Sampler.sample(
            rows.clone(), settings, torch.zeros((1, 0), dtype=torch.long), rng.random(), tokenizer
        )
        counts[int(token.item())] += 1
    return counts / DRAWS


def reference(logits: Any, temperature: float, top_k: int, top_p: float, min_p: float) -> Any:
    """The distribution the docstring of worker.exl2.gpu_sampling defines, in float64."""
    import torch

    p = torch.softmax(logits.half().double() / temperature, -1)
    sp, order = p.sort(descending=True)
    keep = torch.ones_like(sp, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    kept = sp * keep
    kept = kept / kept.sum()
    if top_p < 1.0:
        keep &= (kept.cumsum(0) - kept) < top_p
    keep &= sp >= min_p * sp[0]
    w = torch.zeros_like(p)
    w[order] = sp * keep
    return w / w.sum()


def bucketed(dist: Any, logits: Any) -> Any:
    """A distribution over the vocabulary folded into buckets that 20k draws can estimate:
    each of the likely tokens alone, the long tail in ten groups by logit. (Over 32k single
    tokens, two samples of one tail-heavy distribution differ by a TV of ~0.2 from noise.)"""
    import torch

    order = logits.argsort(descending=True)
    bucket = torch.empty_like(order)
    head = 12
    bucket[order[:head]] = torch.arange(head)
    bucket[order[head:]] = head + torch.arange(order.numel() - head) * 10 // (order.numel() - head)
    return torch.zeros(head + 10, dtype=torch.float64).index_add_(0, bucket, dist.double())


def tv(a: Any, b: Any, logits: Any) -> float:
    return 0.5 * float((bucketed(a, logits) - bucketed(b, logits)).abs().sum())


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(),
        Sampling(temperature=0.6),
        Sampling(top_k=5),
        Sampling(min_p=0.1),
        Sampling(temperature=1.4, top_k=40, min_p=0.02),
    ],
)
def test_the_distribution_is_exllamav2s_own(sampling: Sampling) -> None:
    logits = peaked_logits(32_000, seed=1)
    f = sampler_fields(sampling)
    params = (f["temperature"], f["top_k"], f["top_p"], f["min_p"])
    truncates = f["top_k"] > 1 or f["top_p"] < 1 or f["min_p"] > 0
    gpu, _ = gpu_histogram(logits, params, truncates)
    cpu = cpu_histogram(logits, sampling)
    # Two samples of 20k draws from one distribution differ by a TV of ~0.01 over 22 buckets.
    assert tv(gpu, cpu, logits) < 0.03
    assert tv(gpu, reference(logits, *params), logits) < 0.03


@pytest.mark.parametrize("top_p", [0.6, 0.9])
def test_top_p_keeps_the_smallest_set_that_reaches_it(top_p: float) -> None:
    logits = peaked_logits(32_000, seed=2)
    ref = reference(logits, 1.0, 0, top_p, 0.0)
    hist, picked = gpu_histogram(logits, (1.0, 0, top_p, 0.0), truncates=True)
    # Nothing outside the nucleus, ever (a token whose mass before it is within float32
    # rounding of top_p may fall either side).
    beyond = reference(logits, 1.0, 0, top_p + 1e-4, 0.0) == 0
    assert float(hist[beyond].sum()) == 0.0
    assert 0 < int((hist > 0).sum()) <= int((ref > 0).sum()) + 1
    assert tv(hist, ref, logits) < 0.03
    # The probability reported with each token is its share of the kept mass.
    tokens = picked[:, 0].long()
    assert float((picked[:, 1] - ref[tokens]).abs().max()) < 1e-4


def test_greedy_is_the_argmax_over_a_full_vocabulary() -> None:
    import torch

    logits = torch.randn(8, 128_256, device="cuda").half()
    params = [(0.0, 0, 1.0, 0.0, 0.3)] * 4 + [(1.0, 1, 1.0, 0.0, 0.7)] * 4
    picked = sample_on_device(logits, params, truncates=False)
    assert picked[:, 0].long().tolist() == logits.float().argmax(-1).cpu().tolist()
    assert picked[:, 1].tolist() == [1.0] * 8


# ---- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_engine(tiny_model: Any) -> Iterator[Any]:
    """The same model with exllamav2's CPU sampler only (GENQ_GPU_SAMPLING=false)."""
    from worker.exl2.engine import ExLlamaV2Engine

    e = ExLlamaV2Engine.from_settings(
        Settings(
            model_dir=str(tiny_model),
            engine="exllamav2",
            max_batch=TEST_BATCH,
            cache_tokens=TEST_CACHE_TOKENS,
            gpu_sampling=False,
        )
    )
    yield e
    e.close()


def counters(engine: Any) -> tuple[int, int]:
    s = engine.gpu_sampler
    return s.gpu_tokens, s.cpu_steps


def test_the_engine_samples_plain_jobs_on_the_gpu(engine: Any, cpu_engine: Any) -> None:
    assert cpu_engine.gpu_sampler is None
    rng = random.Random(21)
    jobs = [ejob(f"p{i}", prompt(rng, rng.randint(8, 200)), temperature=0.8) for i in range(16)]
    gpu0, cpu0 = counters(engine)
    out = drive(engine, jobs)
    gpu1, cpu1 = counters(engine)
    produced = sum(len(r.token_ids) for r in out.values())
    assert produced > 0 and all(r.error is None for r in out.values())
    # One GPU sample per token (a sampled stop token ends a job without being output).
    assert produced <= gpu1 - gpu0 <= produced + len(jobs)
    assert cpu1 == cpu0


def test_greedy_tokens_are_the_cpu_samplers(engine: Any, cpu_engine: Any) -> None:
    ids = prompt(random.Random(22), 120)
    on_gpu = drive(engine, [ejob("g", ids, temperature=0.0)])["g"]
    on_cpu = drive(cpu_engine, [ejob("g", ids, temperature=0.0)])["g"]
    assert on_gpu.token_ids and on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu.text == on_cpu.text


def test_a_seed_repeats_its_tokens(engine: Any) -> None:
    ids = prompt(random.Random(23), 60)
    runs = [drive(engine, [ejob("s", ids, temperature=1.0)])["s"].token_ids for _ in range(2)]
    other = drive(engine, [ejob("s-other-seed", ids, temperature=1.0)])["s-other-seed"]
    assert runs[0] and runs[0] == runs[1]
    assert other.token_ids != runs[0]


def test_penalties_and_top_logprobs_share_a_batch_with_gpu_jobs(engine: Any) -> None:
    """Jobs the GPU can't serve take exllamav2's CPU sampler in the same steps."""
    rng = random.Random(24)
    plain = [ejob(f"m{i}", prompt(rng, 50)) for i in range(8)]
    penalised = [ejob(f"r{i}", prompt(rng, 50), repetition_penalty=1.3) for i in range(2)]
    top = ejob("lp3", prompt(rng, 50), logprobs=3)
    gpu0, cpu0 = counters(engine)
    out = drive(engine, [*plain, *penalised, top])
    gpu1, cpu1 = counters(engine)
    assert all(r.error is None and r.token_ids for r in out.values())
    assert cpu1 > cpu0
    plain_tokens = sum(len(out[j.id].token_ids) for j in plain)
    assert plain_tokens <= gpu1 - gpu0 <= plain_tokens + len(plain)


def test_logprobs_of_the_sampled_token_come_from_the_gpu(engine: Any) -> None:
    engine.add(ejob("lp0", prompt(random.Random(25), 20), max_tokens=6, logprobs=0))
    _, cpu0 = counters(engine)
    outs = []
    while engine.active():
        outs += engine.step()
    assert counters(engine)[1] == cpu0
    entries = [e for o in outs if o.logprobs for e in o.logprobs]
    assert len(entries) == sum(len(o.token_ids) for o in outs) > 0
    assert all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 for e in entries)
    assert all(e["top_logprobs"] == [] for e in entries)
