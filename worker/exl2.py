"""The exllamav2 engine: `ExLlamaV2DynamicGenerator` behind genq's `Engine` protocol.

The only module that imports exllamav2 or torch, and only inside `load_backend` (so
`import worker.exl2` works on a CPU install). The engine's logic (admission, cancel, results
→ StepOutputs) talks to the generator through the few methods and attributes it uses, so CPU
tests drive it with a fake generator.

Admission. `fits()` is asked on the asyncio side before a job is claimed from Redis; the job
reaches `add()` on the engine thread a Redis round trip later. Free pages are therefore a
snapshot the engine thread refreshes after every call that changes them, less the pages
already *promised* to jobs that `fits()` admitted and `add()` has not seen yet. A promise
not redeemed within `PROMISE_TTL_S` (the START script refused the job) lapses.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.schemas import FinishReason, ModelCard, Sampling
from worker import exl2_sampling as gpu_sampling
from worker.engine import EngineJob, StepOutput

if TYPE_CHECKING:
    from shared.settings import EngineSettings

log = logging.getLogger(__name__)

PROMISE_TTL_S = 5.0
"""How long pages admitted by `fits()` stay reserved waiting for the job's `add()`."""
PAGE_TOKENS = 256
"""exllamav2's paged-attention page size; cache sizes and chunk sizes are multiples of it."""
MAX_Q_SIZE = 8
"""Tokens per sequence per forward pass that the generator allows for (its default)."""
MAX_SAMPLING_THREADS = 16
"""exllamav2's own default; fewer when this process is pinned to fewer CPUs (worker/cpus.py)."""
DEFAULT_CACHE_TOKENS_PER_JOB = 1024
"""Default cache size per batch slot when `cache_tokens` is not set: room for a typical
prompt + reply without paying for a cache sized for the worst case (which costs speed)."""
FINISH_REASONS: dict[str, FinishReason] = {
    "stop_token": "stop",
    "stop_string": "stop",
    "end_filter": "stop",
    "max_new_tokens": "length",
}


def sampler_fields(s: Sampling) -> dict[str, Any]:
    """Every `ExLlamaV2Sampler.EngineSettings` field, set explicitly: exllamav2's own defaults
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
        **gpu_sampling.UNUSED,
    }


def pages_for(tokens: int, page_size: int) -> int:
    return max(1, math.ceil(tokens / page_size))


@dataclass
class Backend:
    """What the engine needs from exllamav2; `load_backend` builds the real one."""

    make_generator: Callable[[], Any]
    """A fresh generator over the loaded model and cache (called again after a failed step)."""
    make_job: Callable[..., Any]
    """(input_ids, max_new_tokens, sampling, seed, stop_conditions, identifier) → a job."""
    piece: Callable[[int], str]
    """Text of one token id (as the generator decodes it)."""
    close: Callable[[], None] = lambda: None


@dataclass
class _Tracked:
    job: EngineJob
    handle: Any
    prompt_tokens: int


@dataclass
class _Admission:
    """Free pages as last seen by the engine thread, and the pages promised since."""

    free_pages: int
    promises: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ExLlamaV2Engine:
    def __init__(self, backend: Backend, card: ModelCard, tokenizer_json: str) -> None:
        self._backend = backend
        self.card = card
        self.tokenizer_json = tokenizer_json
        self._gen = backend.make_generator()
        self._max_batch = min(card.max_batch, int(self._gen.max_batch_size))
        self._jobs: dict[str, _Tracked] = {}
        self._ready: list[StepOutput] = []
        self._admission = _Admission(free_pages=len(self._gen.unreferenced_pages))

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> ExLlamaV2Engine:
        return cls(*load_backend(settings))

    # ---- protocol -----------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def page_size(self) -> int:
        return int(self._gen.page_size)

    @property
    def total_pages(self) -> int:
        return int(self._gen.max_pages)

    @property
    def gpu_sampler(self) -> Any:
        """The current generator's `exl2_sampling.GpuSampler` (its counters), or None."""
        return getattr(self._gen, "genq_sampler", None)

    def free_pages(self) -> int:
        """Pages no job holds (prefix-cache pages count as free: the generator reuses them)."""
        return len(self._gen.unreferenced_pages)

    def fits(self, need_tokens: int, active: int) -> bool:
        if active >= self._max_batch:
            return False
        need = pages_for(need_tokens, self.page_size)
        if need > self.total_pages:
            return True  # claim it so that add() fails it with a clear error, not leave it queued
        adm = self._admission
        now = time.monotonic()
        with adm.lock:
            if active == 0:
                adm.promises.clear()  # nothing is between fits() and add(): no promise is live
            while adm.promises and adm.promises[0][0] < now:
                adm.promises.popleft()
            promised = sum(p for _, p in adm.promises)
            if need > adm.free_pages - promised:
                return False
            adm.promises.append((now + PROMISE_TTL_S, need))
            return True

    def add(self, job: EngineJob) -> None:
        with self._admission.lock:
            if self._admission.promises:
                self._admission.promises.popleft()
        ids = [*job.input_ids, *job.resume_ids]
        remaining = job.max_tokens - len(job.resume_ids)
        self._check_size(len(ids), max(remaining, 0))
        if remaining <= 0:  # an earlier attempt sent everything but the end
            self._ready.append(
                StepOutput(job.id, finish_reason="length", prompt_tokens=len(job.input_ids))
            )
            return
        stops: list[int | str] = [*self.card.eos_token_ids, *job.sampling.stop_token_ids]
        stops += job.sampling.stop
        handle = self._backend.make_job(ids, remaining, job.sampling, job.seed, stops, job.id)
        self._gen.enqueue(handle)
        self._jobs[job.id] = _Tracked(job, handle, len(job.input_ids))
        self._refresh()

    def cancel(self, job_id: str) -> bool:
        tracked = self._jobs.pop(job_id, None)
        if tracked is None:
            before = len(self._ready)
            self._ready = [o for o in self._ready if o.job_id != job_id]
            return len(self._ready) < before
        self._gen.cancel(tracked.handle)
        self._refresh()
        return True

    def step(self) -> list[StepOutput]:
        outputs, self._ready = self._ready, []
        if self._jobs:
            results = self._gen.iterate()
            outputs += [o for r in results if (o := self._result(r)) is not None]
            self._refresh()
        return outputs

    def active(self) -> int:
        return len(self._jobs) + len(self._ready)

    def reset(self) -> list[str]:
        ids = [*self._jobs, *(o.job_id for o in self._ready)]
        self._jobs.clear()
        self._ready.clear()
        self._gen = self._backend.make_generator()
        with self._admission.lock:
            self._admission.promises.clear()
        self._refresh()
        return ids

    def close(self) -> None:
        for tracked in self._jobs.values():
            self._gen.cancel(tracked.handle)
        self._jobs.clear()
        self._backend.close()

    # ---- internals ----------------------------------------------------------------------

    def _check_size(self, prompt: int, new: int) -> None:
        limit = min(int(self._gen.max_seq_len), self.total_pages * self.page_size)
        if prompt + new > limit:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_tokens ({new}) = {prompt + new} tokens is over "
                f"this worker's limit of {limit} tokens (max sequence length and cache size)"
            )

    def _refresh(self) -> None:
        """Recompute free pages (engine thread only): unreferenced pages, less what jobs
        waiting inside the generator will take when they start."""
        gen = self._gen
        waiting = sum(j.current_new_pages_required() for j in list(gen.pending_jobs))
        self._admission.free_pages = len(gen.unreferenced_pages) - waiting

    def _result(self, r: dict[str, Any]) -> StepOutput | None:
        if r.get("stage") != "streaming":
            return None
        job_id = r.get("identifier")
        tracked = self._jobs.get(job_id) if isinstance(job_id, str) else None
        if tracked is None:
            return None
        text = r.get("text", "")
        token_ids = _flat(r.get("token_ids"))
        probs, top = r.get("token_probs"), (r.get("top_k_tokens"), r.get("top_k_probs"))
        out = StepOutput(job_id=tracked.job.id)
        if r.get("eos"):
            del self._jobs[tracked.job.id]
            reason = r.get("eos_reason", "max_new_tokens")
            if reason == "stop_token":
                # The stop token itself is not output, but text held back before it (a partial
                # stop string, half a UTF-8 character) is.
                text, token_ids, probs, top = self._held_before_stop(r)
            out.finish_reason = FINISH_REASONS.get(reason, "stop")
            out.prompt_tokens = tracked.prompt_tokens
            out.cached_tokens = min(int(r.get("cached_tokens", 0)), tracked.prompt_tokens)
        elif not text and not token_ids:
            return None  # held back (possible stop string): nothing to say yet
        out.text = text
        out.token_ids = token_ids
        n = tracked.job.sampling.logprobs
        if n is not None and token_ids:
            out.logprobs = self._logprobs(token_ids, probs, top, n)
        return out

    def _held_before_stop(self, r: dict[str, Any]) -> tuple[str, list[int], Any, Any]:
        held = r.get("held") or {}
        ids = _flat(held.get("token_ids"))[:-1]
        text = held.get("text", "")
        piece = self._backend.piece(int(r.get("eos_triggering_token_id", -1)))
        if piece and text.endswith(piece):
            text = text[: -len(piece)]
        probs = _rows(held.get("token_probs"))
        ks, kp = _rows(held.get("top_k_tokens")), _rows(held.get("top_k_probs"))
        return text, ids, probs[:-1] if probs else None, (ks[:-1], kp[:-1]) if ks else (None, None)

    def _logprobs(self, ids: list[int], probs: Any, top: Any, n: int) -> list[dict[str, Any]]:
        """exllamav2 reports the final sampling probabilities (after temperature and
        truncation), so these are log-probabilities of the distribution actually sampled."""
        p = _rows(probs)
        k_ids, k_probs = _rows(top[0]), _rows(top[1])
        out = []
        for i, tid in enumerate(ids):
            entry: dict[str, Any] = {
                "token": self._backend.piece(tid),
                "token_id": tid,
                "logprob": _log(p[i]) if i < len(p) else None,
            }
            alts = []
            if n and i < len(k_ids):
                for aid, ap in zip(k_ids[i][:n], k_probs[i][:n], strict=False):
                    alts.append(
                        {
                            "token": self._backend.piece(int(aid)),
                            "token_id": int(aid),
                            "logprob": _log(ap),
                        }
                    )
            entry["top_logprobs"] = alts
            out.append(entry)
        return out


def _tolist(x: Any) -> Any:
    return x.tolist() if hasattr(x, "tolist") else x


def _flat(x: Any) -> list[int]:
    """Token ids of a (1, n) tensor (or nested list) as a flat list."""
    if x is None:
        return []
    v = _tolist(x)
    while v and isinstance(v[0], list):
        v = v[0]
    return [int(t) for t in v]


def _rows(x: Any) -> list[Any]:
    """A (1, n[, k]) tensor's n rows as lists."""
    if x is None:
        return []
    v = _tolist(x)
    return list(v[0]) if v and isinstance(v[0], list) else list(v)


def _log(p: float) -> float:
    return math.log(p) if p > 0 else float("-inf")


# ---- loading (the only code that touches torch and exllamav2) --------------------------


def sampling_threads(configured: int | None = None) -> int:
    """exllamav2 samples each job's logits on the CPU, in a thread pool: GENQ_SAMPLING_THREADS
    if set, else no more threads than this process may use CPUs (its pinned set)."""
    if configured:
        return configured
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_SAMPLING_THREADS, usable or 1))


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _chat_template(tc: dict[str, Any]) -> str | None:
    t = tc.get("chat_template")
    if isinstance(t, list):  # named templates: take the default one
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return t


def build_card(
    settings: EngineSettings,
    model_dir: Path,
    tokenizer_json: str,
    max_seq_len: int,
    max_batch: int,
    eos_ids: list[int],
) -> ModelCard:
    tc = _read_json(model_dir / "tokenizer_config.json")
    cfg = _read_json(model_dir / "config.json")
    bos = _token_text(tc.get("bos_token"))
    synthetic = cfg.get("genq_synthetic")
    return ModelCard(
        name=settings.model_name or model_dir.name,
        engine="exllamav2",
        max_seq_len=max_seq_len,
        max_batch=max_batch,
        tokenizer_sha=hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        bos_token=bos,
        eos_token=_token_text(tc.get("eos_token")),
        eos_token_ids=eos_ids,
        add_bos=bool(tc.get("add_bos_token", bos is not None)),
        chat_template=_chat_template(tc),
        description=synthetic or f"exllamav2 model from {model_dir.name}",
    )


def _eos_ids(model_dir: Path, config_eos: Any) -> list[int]:
    ids: list[int] = []
    gen = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    for v in (config_eos, gen):
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def load_backend(settings: EngineSettings) -> tuple[Backend, ModelCard, str]:
    """Load the model, cache and tokenizer; a factory for generators over them; the card."""
    import torch
    from exllamav2 import (
        ExLlamaV2,
        ExLlamaV2Cache,
        ExLlamaV2Cache_Q4,
        ExLlamaV2Cache_Q6,
        ExLlamaV2Cache_Q8,
        ExLlamaV2Config,
        ExLlamaV2Tokenizer,
    )
    from exllamav2 import attn as exl_attn
    from exllamav2.generator import (
        ExLlamaV2DynamicGenerator,
        ExLlamaV2DynamicJob,
        ExLlamaV2Sampler,
    )

    assert settings.model_dir is not None
    model_dir = Path(settings.model_dir)
    paged = bool(exl_attn.has_flash_attn_with_paged)
    max_batch = settings.max_batch
    if not paged:
        log.warning(
            "flash-attn >= 2.5.7 is not importable: exllamav2 runs unpaged, ONE job at a time "
            "(no batching). Install flash-attn for continuous batching."
        )
        max_batch = 1

    config = ExLlamaV2Config(str(model_dir))
    if settings.max_seq_len:
        config.max_seq_len = settings.max_seq_len
    chunk = _round_up(settings.max_chunk_size, PAGE_TOKENS)
    # The model's forward buffers must hold a prefill chunk and one decode step of the batch.
    config.max_input_len = max(chunk, _round_up(max_batch * MAX_Q_SIZE, PAGE_TOKENS))
    config.max_attention_size = config.max_input_len**2
    model = ExLlamaV2(config)

    if paged:
        wanted = settings.cache_tokens or max(
            config.max_seq_len, max_batch * DEFAULT_CACHE_TOKENS_PER_JOB
        )
        cache_tokens = _round_up(wanted, PAGE_TOKENS)
    else:
        cache_tokens = _round_up(config.max_seq_len, PAGE_TOKENS)
    cache_cls = {
        "FP16": ExLlamaV2Cache,
        "Q4": ExLlamaV2Cache_Q4,
        "Q6": ExLlamaV2Cache_Q6,
        "Q8": ExLlamaV2Cache_Q8,
    }[settings.cache_mode]
    if settings.gpu_split:
        model.load([float(x) for x in settings.gpu_split.split(",")])
        cache = cache_cls(model, max_seq_len=cache_tokens, lazy=False)
    else:
        cache = cache_cls(model, max_seq_len=cache_tokens, lazy=True)
        model.load_autosplit(cache)
    tokenizer = ExLlamaV2Tokenizer(config)
    max_seq_len = min(config.max_seq_len, cache_tokens)
    chunk = min(chunk, config.max_input_len)

    def build_generator() -> Any:
        gen = ExLlamaV2DynamicGenerator(
            model=model,
            cache=cache,
            tokenizer=tokenizer,
            max_batch_size=max_batch,
            max_seq_len=max_seq_len,
            max_chunk_size=chunk,
            max_q_size=MAX_Q_SIZE,
            paged=paged,
            max_sampling_threads=sampling_threads(settings.sampling_threads),
        )
        if settings.gpu_sampling:
            gpu_sampling.install(gen)
        return gen

    job_cls = gpu_sampling.job_class() if settings.gpu_sampling else ExLlamaV2DynamicJob

    def make_job(
        ids: list[int],
        max_new: int,
        sampling: Sampling,
        seed: int,
        stops: list[int | str],
        identifier: str,
    ) -> Any:
        n = sampling.logprobs
        return job_cls(
            input_ids=torch.tensor([ids], dtype=torch.long),
            max_new_tokens=max_new,
            gen_settings=ExLlamaV2Sampler.EngineSettings(**sampler_fields(sampling)),
            seed=seed,
            stop_conditions=stops or None,
            decode_special_tokens=False,
            return_probs=n is not None,
            return_top_tokens=n or 0,
            identifier=identifier,
        )

    pieces = tokenizer.get_id_to_piece_list(False)

    def piece(token_id: int) -> str:
        return pieces[token_id] if 0 <= token_id < len(pieces) else ""

    def close() -> None:
        model.unload()

    warmed = [build_generator()]
    warmed[0].warmup()  # kernel autotuning before the first real job, not during it

    def make_generator() -> Any:
        return warmed.pop() if warmed else build_generator()

    eos_ids = _eos_ids(model_dir, config.eos_token_id)
    tokenizer_json = (model_dir / "tokenizer.json").read_text()
    card = build_card(settings, model_dir, tokenizer_json, max_seq_len, max_batch, eos_ids)
    log.info(
        "exllamav2 model loaded",
        extra={
            "model": card.name,
            "paged": paged,
            "cache_tokens": cache_tokens,
            "cache_mode": settings.cache_mode,
            "max_batch": max_batch,
            "chunk": chunk,
            "gpu_sampling": settings.gpu_sampling,
        },
    )
    return Backend(make_generator, make_job, piece, close), card, tokenizer_json
