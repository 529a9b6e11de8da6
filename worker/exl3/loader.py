"""Loading a model for the exllamav3 engine: config, model, cache (created before the weights
load, as exllamav3 requires), tokenizer, warm-up, the generator and job factories over them
(`Backend`), and the model card. The only code of the engine that touches torch and
exllamav3, and only inside `load_backend` and what it calls; the factories take exllamav3's
classes as arguments, so CPU tests hand them stand-ins.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.schemas import ModelCard, Sampling
from worker.dyngen.backend import (
    PAGE_TOKENS,
    Backend,
    cache_tokens,
    first_warmed,
    piece_lookup,
    round_up,
)
from worker.dyngen.card import build_card, eos_ids
from worker.dyngen.edits import attach, for_library
from worker.dyngen.masks import warm_hook
from worker.exl3 import batch_sampling
from worker.exl3.sampling import checked_kwargs, make_sampler

if TYPE_CHECKING:
    from shared.settings import EngineSettings

log = logging.getLogger(__name__)

RESERVED_TOKENS = 1
"""exllamav3 holds pages for prompt + max_new_tokens + 1 tokens per job (its requeue budget
runs one token past the limit), so a job fits a cache of that many tokens, not one fewer."""
MAX_Q_SIZE = 8
"""Tokens per sequence per forward pass the generator allows for (its default)."""
QUANT_CACHE_BITS = {"Q4": 4, "Q6": 6, "Q8": 8}
"""`--cache-mode` → bits of exllamav3's quantized K/V cache (keys and values alike)."""
GRAPH_BATCHES = 8
"""exllamav3 captures its decode attention as one CUDA graph per batch size up to this many
jobs (`exllamav3.modules.attention_fn.bc_attn.MAX_BSZ`), each at the first step of that size:
the warm-up steps every size up to it, as a burst arriving claim by claim meets them."""
WARMUP_BATCHES = (16, 32, 64, 128, 256)
"""Larger batch sizes run before the worker reports ready (those below max_batch, and
max_batch): the decode shapes genq is benchmarked at, and genq's batched pass (from
GENQ_BATCHED_SAMPLING_MIN_JOBS jobs) at each."""
WARMUP_PROMPTS = (32, 45, 64, 100, 257, 511)
"""Prompt lengths the warm-up's jobs cycle through: multiples of 16 and not (Triton compiles
a kernel again for an integer argument divisible by 16 or not), short and a few pages long,
so the first real prompts' prefill meets kernels compiled already."""
WARMUP_PROMPT_TOKENS = WARMUP_PROMPTS[0]
WARMUP_NEW_TOKENS = 4
LONG_PREFILL_CHUNKS = 2
"""The warm-up's long prompt: this many prefill chunks (within the sequence length)."""
WARMUP_LOWEST_TOKEN = 256
"""Warm-up prompts use token ids from here up, clear of the special tokens most
vocabularies begin with."""
WARMUP_SAMPLINGS = (
    Sampling(),
    Sampling(temperature=0.0),
    Sampling(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    Sampling(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    Sampling(logprobs=5),
    Sampling(min_tokens=2, logit_bias={str(WARMUP_LOWEST_TOKEN): 1.0}),
)
"""Warm-up jobs cycle through these: each of the sampler's kernel paths runs once (exllamav3's
own, genq's batched pass with and without truncation, genq's edits)."""


@dataclass(frozen=True)
class WarmRun:
    """One warm-up run: `jobs` dummy jobs enqueued at once, run to their end."""

    label: str
    jobs: int
    samplings: tuple[Sampling, ...] = WARMUP_SAMPLINGS
    """Cycled through by the jobs."""
    prompts: tuple[int, ...] = (WARMUP_PROMPT_TOKENS,)
    """Prompt lengths, cycled through by the jobs."""
    new_tokens: int = WARMUP_NEW_TOKENS


def warmup_plan(shape: Shape, min_jobs: int = 1) -> list[WarmRun]:
    """What the warm-up runs, in order: each batch size up to `GRAPH_BATCHES`; each of
    `WARMUP_BATCHES` below max_batch and max_batch, their prompts of every length of
    `WARMUP_PROMPTS`; a batch of neutral jobs (genq's batched pass without truncation, from
    `min_jobs` jobs: GENQ_BATCHED_SAMPLING_MIN_JOBS); a burst of max_batch jobs of every
    prompt length (the first traffic's prefill: several jobs per pass); one long prefill."""
    top = shape.max_batch
    room = shape.max_seq_len - WARMUP_NEW_TOKENS
    prompts = tuple(n for n in WARMUP_PROMPTS if n <= room) or (max(1, room),)
    short = (prompts[0],)
    runs = [WarmRun(f"graph{n}", n, prompts=short) for n in range(1, min(GRAPH_BATCHES, top) + 1)]
    sizes = sorted({b for b in WARMUP_BATCHES if GRAPH_BATCHES < b < top} | {top})
    runs += [WarmRun(f"batch{n}", n, prompts=prompts) for n in sizes if n > GRAPH_BATCHES]
    plain = min(top, max(min_jobs, GRAPH_BATCHES))
    runs.append(WarmRun("plain", plain, samplings=(Sampling(),), prompts=short))
    runs.append(WarmRun("burst", top, samplings=(Sampling(),), prompts=prompts))
    long = min(LONG_PREFILL_CHUNKS * shape.chunk, room)
    runs.append(WarmRun("long", 1, samplings=(Sampling(),), prompts=(long,)))
    return runs


@dataclass(frozen=True)
class Shape:
    """The generator's limits, decided once at load."""

    max_batch: int
    max_seq_len: int
    """Most tokens (prompt + max new) of one job: the model's, within the cache."""
    cache_tokens: int
    chunk: int
    shared_chunk: int
    prefill_cooldown: int


def shape_for(settings: EngineSettings, model_seq_len: int) -> Shape:
    """Cache sized as for exllamav2 (`GENQ_CACHE_TOKENS`, else room for the batch); the
    prefill chunk within the cache; the shared chunk within the chunk; all in whole pages."""
    cache = cache_tokens(settings.cache_tokens, model_seq_len, settings.max_batch)
    chunk = min(round_up(settings.max_chunk_size, PAGE_TOKENS), cache)
    shared = min(round_up(settings.shared_chunk_size or chunk, PAGE_TOKENS), chunk)
    return Shape(
        max_batch=settings.max_batch,
        max_seq_len=min(model_seq_len, cache - RESERVED_TOKENS),
        cache_tokens=cache,
        chunk=chunk,
        shared_chunk=shared,
        prefill_cooldown=settings.prefill_cooldown,
    )


def generator_kwargs(model: Any, cache: Any, tokenizer: Any, shape: Shape) -> dict[str, Any]:
    return {
        "model": model,
        "cache": cache,
        "tokenizer": tokenizer,
        "max_batch_size": shape.max_batch,
        "max_chunk_size": shape.chunk,
        "shared_chunk_size": shape.shared_chunk,
        "prefill_cooldown": shape.prefill_cooldown,
        "max_q_size": MAX_Q_SIZE,
    }


def generator_builder(
    generator_cls: Callable[..., Any],
    kwargs: dict[str, Any],
    install: Callable[[Any], Any] | None = None,
) -> Callable[[], Any]:
    """A fresh generator over the loaded model and cache on each call (after a failed step:
    the new one takes the cache over, the old one refuses to run), `install`ed on if given."""
    checked = checked_kwargs(generator_cls, kwargs)

    def build() -> Any:
        gen = generator_cls(**checked)
        if install is not None:
            install(gen)
        return gen

    return build


def job_args(
    input_ids: Any,
    max_new: int,
    sampler: Any,
    seed: int,
    stops: list[int | str],
    identifier: str,
    sampling: Sampling,
) -> dict[str, Any]:
    """Every `Job` argument genq relies on, explicit: `max_new_tokens` above all (left out,
    exllamav3 lets a job run to the end of the cache), and no token budget, so the generator
    never requeues a job on its own."""
    logprobs = sampling.logprobs
    return {
        "input_ids": input_ids,
        "max_new_tokens": max_new,
        "min_new_tokens": sampling.min_tokens,
        "sampler": sampler,
        "seed": seed,
        "stop_conditions": stops,
        "decode_special_tokens": False,
        "return_top_tokens": logprobs or 0,
        "return_probs": logprobs is not None,
        "identifier": identifier,
        "token_healing": False,
        "banned_strings": sampling.banned_strings or None,
        "max_rq_tokens": None,
        "stop_on_loop": None,
    }


def job_factory(
    job_cls: Callable[..., Any],
    sampler_cls: Callable[..., Any],
    as_ids: Callable[[list[int]], Any],
    batched: bool = False,
) -> Callable[..., Any]:
    """`Backend.make_job`: (ids, max_new, sampling, seed, stops, identifier) → a `Job` with
    its own explicit `ComboSampler`; `batched`: marked for the batched pass where its
    settings allow (`batch_sampling.row_params`)."""

    def make_job(
        ids: list[int],
        max_new: int,
        sampling: Sampling,
        seed: int,
        stops: list[int | str],
        identifier: str,
    ) -> Any:
        sampler = make_sampler(sampler_cls, sampling)
        args = job_args(as_ids(ids), max_new, sampler, seed, stops, identifier, sampling)
        job = job_cls(**checked_kwargs(job_cls, args))
        if batched:
            job.genq_params = batch_sampling.row_params(sampling)
        return job

    return make_job


def use_triton_cache(path: str | None) -> None:
    """Point Triton's kernel cache at `path` (GENQ_TRITON_CACHE_DIR), before anything imports
    Triton; unset, the environment's (or Triton's own) stays."""
    if path:
        folder = Path(path).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(folder)


# ---- loading --------------------------------------------------------------------------------


def load_backend(settings: EngineSettings) -> tuple[Backend, ModelCard, str]:
    """Load the model, cache and tokenizer, warm them up; a factory for generators over them
    (the first one warmed up too); the card."""
    assert settings.model_dir is not None
    model_dir = Path(settings.model_dir)
    use_triton_cache(settings.triton_cache_dir)
    import exllamav3 as ex  # imports torch before its extension, as the extension needs
    import torch

    torch.set_num_threads(settings.torch_threads)
    config = ex.Config.from_directory(str(model_dir))
    shape = shape_for(settings, settings.max_seq_len or int(config.max_position_embeddings))
    model = ex.Model.from_config(config)
    cache = _make_cache(ex, model, settings.cache_mode, shape)
    model.load(**checked_kwargs(type(model).load_gen, _load_args(settings, shape)))
    tokenizer = ex.Tokenizer.from_config(config)

    def as_ids(ids: list[int]) -> Any:
        return torch.tensor([ids], dtype=torch.long)

    batched = settings.batched_sampling
    vocab = int(config.vocab_size)
    make_job = job_factory(batch_sampling.job_class(), ex.ComboSampler, as_ids, batched)
    install = functools.partial(
        batch_sampling.install,
        min_jobs=settings.batched_sampling_min_jobs,
        vocab_size=vocab,
        batched=batched,
    )
    build = generator_builder(
        ex.Generator, generator_kwargs(model, cache, tokenizer, shape), install
    )
    warmed = _warm(
        model,
        cache,
        build,
        make_job,
        shape,
        int(tokenizer.actual_vocab_size),
        settings.batched_sampling_min_jobs if batched else 1,
    )
    tokenizer_json = (model_dir / "tokenizer.json").read_text()
    eos = eos_ids(model_dir, config.eos_token_id_list)
    card = build_card(
        settings, model_dir, tokenizer_json, shape.max_seq_len, shape.max_batch, eos, "exllamav3"
    )
    extra = {
        "model": card.name,
        "cache_mode": settings.cache_mode,
        "batched_sampling": batched,
        "batched_sampling_min_jobs": settings.batched_sampling_min_jobs,
        **asdict(shape),
    }
    log.info("exllamav3 model loaded", extra=extra)

    make_generator = first_warmed(warmed, build)
    piece = piece_lookup(tokenizer)
    backend = Backend(make_generator, make_job, piece, model.unload, vocab_size=vocab)
    return backend, card, tokenizer_json


def _make_cache(ex: Any, model: Any, mode: str, shape: Shape) -> Any:
    """An fp16 or quantized K/V cache; `max_batch_size` sizes the state slots of models with
    recurrent layers (their batch is limited to it)."""
    args: dict[str, Any] = {"max_num_tokens": shape.cache_tokens, "max_batch_size": shape.max_batch}
    if mode in QUANT_CACHE_BITS:
        bits = QUANT_CACHE_BITS[mode]
        return ex.Cache(model, layer_type=ex.CacheLayer_quant, k_bits=bits, v_bits=bits, **args)
    return ex.Cache(model, layer_type=ex.CacheLayer_fp16, **args)


def _load_args(settings: EngineSettings, shape: Shape) -> dict[str, Any]:
    """`model.load`: the GPUs this process sees, split by exllamav3 around the cache, or GB per
    GPU as GENQ_GPU_SPLIT says."""
    args: dict[str, Any] = {
        "max_chunk_size": shape.chunk,
        "max_batch_size": shape.max_batch,
        "max_output_size": shape.max_batch,
        "progressbar": False,
    }
    if settings.gpu_split:
        args["use_per_device"] = [float(x) for x in settings.gpu_split.split(",")]
    return args


# ---- warm-up --------------------------------------------------------------------------------


def _warm(
    model: Any,
    cache: Any,
    build: Callable[[], Any],
    make_job: Callable[..., Any],
    shape: Shape,
    vocab: int,
    min_jobs: int,
) -> Any:
    """The model's own warm-up passes (before any generator: they write the cache), then a
    generator, warmed up with dummy jobs; returns that generator."""
    started = time.monotonic()
    failed = model.warmup(cache=cache, max_chunk_size=shape.chunk, max_batch_size=shape.max_batch)
    if failed:
        log.warning("exllamav3 warm-up passes failed", extra={"passes": failed})
    gen = build()
    warm_up(gen, make_job, shape, vocab, min_jobs)
    log.info("exllamav3 warmed up", extra={"seconds": round(time.monotonic() - started, 1)})
    return gen


def warm_up(
    gen: Any, make_job: Callable[..., Any], shape: Shape, vocab: int, min_jobs: int = 1
) -> None:
    """Dummy jobs through the generator before the worker reports ready (`warmup_plan`), so
    Triton compiles and the decode paths are captured before the first real job, not during
    it; then genq's hook's own kernels (its masks and edits) once, at the largest batch."""
    rng = random.Random(0)
    low = min(WARMUP_LOWEST_TOKEN, vocab - 1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    for run in warmup_plan(shape, min_jobs):
        jobs = []
        for i in range(run.jobs):
            s = run.samplings[i % len(run.samplings)]
            n = run.prompts[i % len(run.prompts)]
            job = make_job(ids(n), run.new_tokens, for_library(s), i, [], f"warmup-{run.label}-{i}")
            if s.min_tokens or s.logit_bias:  # genq's edits, as the engine attaches them
                attach(job, s, [low], vocab)
            jobs.append(job)
        _run(gen, jobs)
    warm_hook(gen, shape.max_batch, vocab)


def _run(gen: Any, jobs: list[Any]) -> None:
    for job in jobs:
        gen.enqueue(job)
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") == "error":
                raise RuntimeError(f"exllamav3 warm-up job failed: {r.get('error')!r}")
