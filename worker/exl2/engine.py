"""The engine: cancel, and generator steps → StepOutputs.

It talks to the generator through the few methods and attributes it uses, so CPU tests drive
it with a fake generator. Admission is the worker's (worker/admission.py): the engine reports
its free pages after each call that changes them (`free_pages`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.schemas import ModelCard
from worker.engine import EngineJob, StepOutput
from worker.exl2.loader import SAMPLING_SUPPORT, Backend, load_backend
from worker.exl2.results import step_output

if TYPE_CHECKING:
    from shared.settings import EngineSettings

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    job: EngineJob
    handle: Any
    prompt_tokens: int


class ExLlamaV2Engine:
    sampling_support = SAMPLING_SUPPORT

    def __init__(self, backend: Backend, card: ModelCard, tokenizer_json: str) -> None:
        self._backend = backend
        self.card = card
        self.tokenizer_json = tokenizer_json
        self._gen = backend.make_generator()
        self._max_batch = min(card.max_batch, int(self._gen.max_batch_size))
        self._jobs: dict[str, _Tracked] = {}
        self._ready: list[StepOutput] = []

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
        """Pages no job holds (prefix-cache pages count as free: the generator reuses them),
        less what jobs waiting inside the generator will take when they start."""
        gen = self._gen
        waiting = sum(j.current_new_pages_required() for j in list(gen.pending_jobs))
        return len(gen.unreferenced_pages) - waiting

    def add(self, job: EngineJob) -> None:
        ids = [*job.input_ids, *job.resume_ids]
        remaining = job.max_tokens - len(job.resume_ids)
        self._check_size(len(ids), max(remaining, 0))
        if remaining <= 0:  # an earlier attempt sent everything but the end
            self._ready.append(
                StepOutput(job.id, finish_reason="length", prompt_tokens=len(job.input_ids))
            )
            return
        stops: list[int | str] = [*self.card.eos_token_ids, *job.sampling.stop_token_ids]
        if job.text:  # else the worker matches stop strings in the text it makes
            stops += job.sampling.stop
        handle = self._backend.make_job(ids, remaining, job.sampling, job.seed, stops, job.id)
        self._gen.enqueue(handle)
        self._jobs[job.id] = _Tracked(job, handle, len(job.input_ids))

    def cancel(self, job_id: str) -> bool:
        tracked = self._jobs.pop(job_id, None)
        if tracked is None:
            before = len(self._ready)
            self._ready = [o for o in self._ready if o.job_id != job_id]
            return len(self._ready) < before
        self._gen.cancel(tracked.handle)
        return True

    def step(self) -> list[StepOutput]:
        outputs, self._ready = self._ready, []
        if self._jobs:
            results = self._gen.iterate()
            outputs += [o for r in results if (o := self._result(r)) is not None]
        return outputs

    def active(self) -> int:
        return len(self._jobs) + len(self._ready)

    def reset(self) -> list[str]:
        ids = [*self._jobs, *(o.job_id for o in self._ready)]
        self._jobs.clear()
        self._ready.clear()
        self._gen = self._backend.make_generator()
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
