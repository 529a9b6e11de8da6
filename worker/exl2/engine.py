"""The engine: admission, cancel, and generator steps → StepOutputs.

It talks to the generator through the few methods and attributes it uses, so CPU tests drive
it with a fake generator.

Admission. `fits()` is asked on the asyncio side before a job is claimed from Redis; the job
reaches `add()` on the engine thread a Redis round trip later. Free pages are therefore a
snapshot the engine thread refreshes after every call that changes them, less the pages
already *promised* to jobs that `fits()` admitted and `add()` has not seen yet. A promise
not redeemed within `PROMISE_TTL_S` (the START script refused the job) lapses.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.schemas import ModelCard
from worker.engine import EngineJob, StepOutput
from worker.exl2.loader import Backend, load_backend
from worker.exl2.results import step_output

if TYPE_CHECKING:
    from shared.settings import EngineSettings

log = logging.getLogger(__name__)

PROMISE_TTL_S = 5.0
"""How long pages admitted by `fits()` stay reserved waiting for the job's `add()`."""


def pages_for(tokens: int, page_size: int) -> int:
    return max(1, math.ceil(tokens / page_size))


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
        """The current generator's `gpu_sampling.GpuSampler` (its counters), or None."""
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
        if r.get("eos"):
            del self._jobs[tracked.job.id]
        return step_output(r, tracked.job, tracked.prompt_tokens, self._backend.piece)
