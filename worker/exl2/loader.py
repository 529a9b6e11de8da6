"""Loading a model for the exllamav2 engine: config, model, cache, tokenizer, the generator
and job factories over them (`Backend`), and the model card (worker/dyngen/card.py). The only
code of the engine that touches torch and exllamav2 (with `gpu_sampling`), and only inside
functions."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
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
from worker.dyngen.masks import warm_hook
from worker.engine import SamplingSupport
from worker.exl2 import gpu_sampling

if TYPE_CHECKING:
    from shared.settings import EngineSettings

log = logging.getLogger(__name__)

MAX_Q_SIZE = 8
"""Tokens per sequence per forward pass that the generator allows for (its default)."""
MAX_SAMPLING_THREADS = 16
"""exllamav2's own default; fewer when this process is pinned to fewer CPUs (worker/cpus.py)."""
MAX_SEQ_LEN_KEYS = (
    "max_sequence_length",
    "model_max_length",
    "max_position_embeddings",
    "max_seq_len",
    "n_positions",
)
"""config.json keys `ExLlamaV2Config` takes the model's sequence length from, the first present
one winning; `EXL2_DEFAULT_MAX_SEQ_LEN` when none is."""
EXL2_DEFAULT_MAX_SEQ_LEN = 2048
LOGITS_ALIGN = 32
"""exllamav2's generator pads each row of logits to a multiple of this many tokens
(`padded_vocab_size`); a job's `token_bias` is added to such a row, so it is as long."""


@dataclass(frozen=True)
class _Shape:
    """The generator's limits, decided once at load."""

    paged: bool
    max_batch: int
    max_seq_len: int
    chunk: int


@dataclass(frozen=True)
class ForwardSizes:
    max_batch: int
    chunk: int
    """Prefill chunk: prompt tokens forwarded (and written to the cache) at once."""
    max_input_len: int
    """Tokens the model's forward buffers hold: a prefill chunk, or a decode step of the batch."""


def forward_sizes(
    max_chunk_size: int, cache_size: int, max_batch: int, max_seq_len: int
) -> ForwardSizes:
    """Chunk and forward buffers never longer than the cache (nor the sequence length):
    exllamav2 writes a whole chunk into the cache, and its automatic split forwards
    `max_input_len` tokens through it at load, so a 2,048-token chunk over a 768-token cache
    fails ("start (0) + length (2048) exceeds dimension size (768)"). The batch is cut to
    what a decode step within those buffers carries (the generator needs batch ×
    `MAX_Q_SIZE` of them); each job takes a page or more, so no more could run anyway."""
    limit = max(PAGE_TOKENS, min(cache_size, max_seq_len) // PAGE_TOKENS * PAGE_TOKENS)
    chunk = min(round_up(max_chunk_size, PAGE_TOKENS), limit)
    batch = max(1, min(max_batch, limit // MAX_Q_SIZE))
    decode = round_up(batch * MAX_Q_SIZE, PAGE_TOKENS)
    return ForwardSizes(batch, chunk, min(max(chunk, decode), limit))


def sampler_fields(s: Sampling) -> dict[str, Any]:
    """Every `ExLlamaV2Sampler.Settings` field, set explicitly: exllamav2's own defaults
    (temperature 0.8, top_k 50, top_p 0.8, repetition penalty 1.025) are not neutral."""
    greedy = s.temperature == 0.0
    return {
        "temperature": 1.0 if greedy else s.temperature,
        "top_k": 1 if greedy else s.top_k,
        "top_p": 1.0 if greedy else s.top_p,
        "min_p": 0.0 if greedy else s.min_p,
        "token_repetition_penalty": s.repetition_penalty,
        "token_repetition_range": -1,
        "token_repetition_decay": 0,
        "token_presence_penalty": s.presence_penalty,
        "token_frequency_penalty": s.frequency_penalty,
        "temp_exponent": 1.0,
        "token_bias": None,
        **gpu_sampling.UNUSED,
    }


def job_fields(s: Sampling) -> dict[str, Any]:
    """The sampler settings exllamav2 takes as arguments of the job, not of its sampler."""
    return {"min_new_tokens": s.min_tokens, "banned_strings": s.banned_strings or None}


PER_JOB = {
    "repetition_penalty": "exllamav2's CPU sampler penalises over the job's context, which "
    "only the library holds (on the host, per job)",
    "presence_penalty": "as repetition_penalty",
    "frequency_penalty": "as repetition_penalty",
    "logprobs": "top logprobs (logprobs > 0): exllamav2's CPU sampler sorts the job's row for "
    "them (logprobs 0, the sampled token's own, stays on the pass)",
    "banned_strings": "exllamav2 rewinds the job to a checkpoint and samples again with the "
    "tokens it tried blocked: per job by nature",
}
"""Settings that leave a job to exllamav2's CPU sampler (`gpu_sampling.job_params` is None):
a step with one such job copies every row's logits to the host (docs/performance.md)."""

SAMPLING_SUPPORT = SamplingSupport(
    sampler=frozenset(
        {
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        }
    ),
    elsewhere={
        "seed": "`make_job`'s seed: `EngineJob.seed` (the spec's, else one drawn from the job id)",
        "stop": "the engine's `add`: stop conditions (the worker matches them without `job.text`)",
        "stop_token_ids": "the engine's `add`: stop conditions",
        "logprobs": "`make_job`: return_probs and return_top_tokens",
        "logit_bias": "genq's hook (worker/dyngen/edits.py): added to the job's row of the "
        "logits on the device (without the hook: the sampler's token_bias, `make_job`)",
        "min_tokens": "genq's hook (worker/dyngen/edits.py): the stop tokens masked in the job's "
        "row until then (without the hook: `job_fields`' min_new_tokens); less what an "
        "earlier attempt sent",
        "banned_strings": "`job_fields`: banned_strings",
    },
    per_job=PER_JOB,
)
"""Where the exllamav2 engine honours each sampler setting: `sampler_fields` maps the rest."""


def sampling_threads(configured: int | None = None) -> int:
    """exllamav2 samples each job's logits on the CPU, in a thread pool: GENQ_SAMPLING_THREADS
    if set, else no more threads than this process may use CPUs (its pinned set)."""
    if configured:
        return configured
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_SAMPLING_THREADS, usable or 1))


def max_seq_len(settings: EngineSettings) -> int | None:
    """The sequence length the engine runs the model at, known without loading it:
    GENQ_MAX_SEQ_LEN if set, else the model's as exllamav2 reads it from config.json; None
    without a model folder whose config.json can be read."""
    if settings.max_seq_len:
        return settings.max_seq_len
    if not settings.model_dir:
        return None
    try:
        cfg = json.loads((Path(settings.model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = (cfg[k] for k in MAX_SEQ_LEN_KEYS if isinstance(cfg.get(k), int))
    return next(found, EXL2_DEFAULT_MAX_SEQ_LEN)


# ---- loading --------------------------------------------------------------------------------


def load_backend(settings: EngineSettings) -> tuple[Backend, ModelCard, str]:
    """Load the model, cache and tokenizer; a factory for generators over them; the card."""
    import torch
    from exllamav2 import ExLlamaV2Tokenizer

    torch.set_num_threads(settings.torch_threads)
    assert settings.model_dir is not None
    model_dir = Path(settings.model_dir)
    paged = _paged_attention()
    config = _model_config(settings, model_dir)
    wanted_batch = settings.max_batch if paged else 1
    cache_size = cache_tokens(settings.cache_tokens, config.max_seq_len, wanted_batch, paged)
    sizes = forward_sizes(settings.max_chunk_size, cache_size, wanted_batch, config.max_seq_len)
    config.max_input_len = sizes.max_input_len
    config.max_attention_size = sizes.max_input_len**2
    max_batch = sizes.max_batch
    model, cache = _load_model(settings, config, cache_size)
    tokenizer = ExLlamaV2Tokenizer(config)
    shape = _Shape(
        paged=paged,
        max_batch=max_batch,
        max_seq_len=min(config.max_seq_len, cache_size),
        chunk=sizes.chunk,
    )
    make_job = _job_factory(round_up(config.vocab_size, LOGITS_ALIGN))
    piece = piece_lookup(tokenizer)
    vocab = int(config.vocab_size)
    make_generator = _warm_generator_factory(settings, model, cache, tokenizer, shape, vocab)
    eos = eos_ids(model_dir, config.eos_token_id)
    tokenizer_json = (model_dir / "tokenizer.json").read_text()
    card = build_card(
        settings, model_dir, tokenizer_json, shape.max_seq_len, max_batch, eos, "exllamav2"
    )
    log.info(
        "exllamav2 model loaded",
        extra={
            "model": card.name,
            "paged": paged,
            "cache_tokens": cache_size,
            "cache_mode": settings.cache_mode,
            "max_batch": max_batch,
            "chunk": shape.chunk,
            "gpu_sampling": settings.gpu_sampling,
        },
    )
    backend = Backend(make_generator, make_job, piece, model.unload, vocab_size=vocab)
    return backend, card, tokenizer_json


def _paged_attention() -> bool:
    """Whether flash-attn's paged attention is there; without it exllamav2 runs one job at
    a time."""
    from exllamav2 import attn as exl_attn

    paged = bool(exl_attn.has_flash_attn_with_paged)
    if not paged:
        log.warning(
            "flash-attn >= 2.5.7 is not importable: exllamav2 runs unpaged, ONE job at a time "
            "(no batching). Install flash-attn for continuous batching."
        )
    return paged


def _model_config(settings: EngineSettings, model_dir: Path) -> Any:
    """The model's config with genq's sequence length (forward sizes are set by the caller)."""
    from exllamav2 import ExLlamaV2Config

    config = ExLlamaV2Config(str(model_dir))
    if settings.max_seq_len:
        config.max_seq_len = settings.max_seq_len
    return config


def _load_model(settings: EngineSettings, config: Any, cache_size: int) -> tuple[Any, Any]:
    """The model's weights on the GPU(s) (split as GENQ_GPU_SPLIT says, else automatically
    around the cache) and a cache of `cache_size` tokens."""
    from exllamav2 import (
        ExLlamaV2,
        ExLlamaV2Cache,
        ExLlamaV2Cache_Q4,
        ExLlamaV2Cache_Q6,
        ExLlamaV2Cache_Q8,
    )

    model = ExLlamaV2(config)
    cache_cls = {
        "FP16": ExLlamaV2Cache,
        "Q4": ExLlamaV2Cache_Q4,
        "Q6": ExLlamaV2Cache_Q6,
        "Q8": ExLlamaV2Cache_Q8,
    }[settings.cache_mode]
    if settings.gpu_split:
        model.load([float(x) for x in settings.gpu_split.split(",")])
        cache = cache_cls(model, max_seq_len=cache_size, lazy=False)
    else:
        cache = cache_cls(model, max_seq_len=cache_size, lazy=True)
        model.load_autosplit(cache)
    return model, cache


def _warm_generator_factory(
    settings: EngineSettings, model: Any, cache: Any, tokenizer: Any, shape: _Shape, vocab: int
) -> Callable[[], Any]:
    """A factory of generators over the loaded model and cache, each with genq's hook (the
    constrained jobs' masks, and GPU sampling unless GENQ_GPU_SAMPLING is off); the first is
    built and warmed up now (kernel autotuning before the first real job, not during it)."""
    from exllamav2.generator import ExLlamaV2DynamicGenerator

    def build_generator() -> Any:
        gen = ExLlamaV2DynamicGenerator(
            model=model,
            cache=cache,
            tokenizer=tokenizer,
            max_batch_size=shape.max_batch,
            max_seq_len=shape.max_seq_len,
            max_chunk_size=shape.chunk,
            max_q_size=MAX_Q_SIZE,
            paged=shape.paged,
            max_sampling_threads=sampling_threads(settings.sampling_threads),
        )
        gpu_sampling.install(gen, vocab, sample=settings.gpu_sampling)
        return gen

    warmed = build_generator()
    warmed.warmup()
    warm_hook(warmed, shape.max_batch, round_up(vocab, LOGITS_ALIGN))
    return first_warmed(warmed, build_generator)


def _job_factory(logits_width: int) -> Callable[..., Any]:
    """`Backend.make_job` over exllamav2's classes: jobs of genq's class
    (`gpu_sampling.job_class`: it takes GPU-sampled tokens when GPU sampling is on, and feeds
    its constraint's matcher)."""
    import torch
    from exllamav2.generator import ExLlamaV2Sampler

    def as_ids(ids: list[int]) -> Any:
        return torch.tensor([ids], dtype=torch.long)

    def bias(logit_bias: dict[str, float]) -> Any:
        return token_bias(logit_bias, logits_width)

    return job_factory(gpu_sampling.job_class(), ExLlamaV2Sampler.Settings, as_ids, bias)


def job_factory(
    job_cls: Callable[..., Any],
    settings_cls: Callable[..., Any],
    as_ids: Callable[[list[int]], Any],
    bias: Callable[[dict[str, float]], Any],
) -> Callable[..., Any]:
    """(ids, max_new, sampling, seed, stops, identifier) → a `job_cls` job with explicit
    sampler settings (`settings_cls`); the library's classes and tensors come as arguments,
    so CPU tests hand stand-ins."""

    def make_job(
        ids: list[int],
        max_new: int,
        sampling: Sampling,
        seed: int,
        stops: list[int | str],
        identifier: str,
    ) -> Any:
        n = sampling.logprobs
        fields = sampler_fields(sampling)
        if sampling.logit_bias:
            fields["token_bias"] = bias(sampling.logit_bias)
        return job_cls(
            input_ids=as_ids(ids),
            max_new_tokens=max_new,
            gen_settings=settings_cls(**fields),
            seed=seed,
            stop_conditions=stops or None,
            decode_special_tokens=False,
            return_probs=n is not None,
            return_top_tokens=n or 0,
            identifier=identifier,
            **job_fields(sampling),
        )

    return make_job


def token_bias(logit_bias: dict[str, float], width: int) -> Any:
    """`logit_bias` as exllamav2's sampler adds it to a row of logits: a float32 vector on the
    host, `width` long (an id past the row's end is no token the model can give)."""
    import torch

    bias = torch.zeros((width,), dtype=torch.float)
    entries = [(int(k), v) for k, v in logit_bias.items() if int(k) < width]
    if entries:
        ids, values = zip(*entries, strict=True)
        bias[list(ids)] = torch.tensor(values, dtype=torch.float)
    return bias
