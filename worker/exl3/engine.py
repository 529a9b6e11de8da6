"""The engine: cancel, and generator steps → StepOutputs.

It talks to exllamav3's `Generator` through the few methods and attributes it uses
(`enqueue`, `cancel`, `iterate`, `close`, `pending_jobs`, `max_batch_size`, its `pagetable`'s
`max_pages` and `num_unreferenced_pages()`, a job's `current_new_pages_required()`), so CPU
tests drive it with a fake generator.

Admission is the worker's (worker/admission.py), against the pages this engine reports:
free = unreferenced pages (those holding a reusable prompt prefix count: the generator evicts
them when it needs the room) less what jobs waiting in the generator will take when they
start; exllamav3 holds one token more per job than prompt + max new (`reserved_tokens`). A
job that could never fit is refused in `add()` before anything is enqueued: left to
exllamav3, it fails an assertion in `enqueue`, or with no `max_new_tokens` runs to the end of
the cache.

A failed `iterate()` leaves no job's state trustworthy: `reset()` closes that generator and
builds a new one over the same model and cache (no reload); the runner fails its jobs, and
the worker hands them back to the queue for another attempt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.schemas import ModelCard
from worker.engine import EngineJob, StepOutput
from worker.exl2.loader import Backend
from worker.exl3.loader import PAGE_TOKENS, RESERVED_TOKENS, load_backend
from worker.exl3.results import error_output, streaming_output
from worker.exl3.sampling import SAMPLING_SUPPORT

if TYPE_CHECKING:
    from shared.settings import EngineSettings

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    job: EngineJob
    handle: Any
    prompt_tokens: int


class ExLlamaV3Engine:
    sampling_support = SAMPLING_SUPPORT

    def __init__(self, backend: Backend, card: ModelCard, tokenizer_json: str) -> None:
        self._backend = backend
        self.card = card
        self.tokenizer_json = tokenizer_json
        self._gen = backend.make_generator()
        self._max_batch = min(card.max_batch, int(self._gen.max_batch_size))
        self._jobs: dict[int, _Tracked] = {}
        """By the serial `enqueue` returned: every result names its job by it."""
        self._serials: dict[str, int] = {}
        self._ready: list[StepOutput] = []

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> ExLlamaV3Engine:
        return cls(*load_backend(settings))

    # ---- protocol -----------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def page_size(self) -> int:
        return PAGE_TOKENS

    @property
    def total_pages(self) -> int:
        return int(self._gen.pagetable.max_pages)

    @property
    def reserved_tokens(self) -> int:
        return RESERVED_TOKENS

    @property
    def batch_sampler(self) -> Any:
        """The current generator's `batch_sampling.BatchSampler` (its counters), or None."""
        return getattr(self._gen, "genq_sampler", None)

    def free_pages(self) -> int:
        """Pages no job holds (prefix-cache pages count as free: the generator reuses them),
        less what jobs waiting inside the generator will take when they start."""
        gen = self._gen
        waiting = sum(j.current_new_pages_required() for j in list(gen.pending_jobs))
        return int(gen.pagetable.num_unreferenced_pages()) - waiting

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
        serial = int(self._gen.enqueue(handle))
        self._jobs[serial] = _Tracked(job, handle, len(job.input_ids))
        self._serials[job.id] = serial

    def cancel(self, job_id: str) -> bool:
        serial = self._serials.pop(job_id, None)
        if serial is None:
            before = len(self._ready)
            self._ready = [o for o in self._ready if o.job_id != job_id]
            return len(self._ready) < before
        tracked = self._jobs.pop(serial)
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
        ids = [*self._serials, *(o.job_id for o in self._ready)]
        self._jobs.clear()
        self._serials.clear()
        self._ready.clear()
        try:
            self._gen.close()
        except Exception:  # a broken generator's buffers: the new one does not need them
            log.exception("closing the failed exllamav3 generator failed")
        self._gen = self._backend.make_generator()
        return ids

    def close(self) -> None:
        for tracked in self._jobs.values():
            self._gen.cancel(tracked.handle)
        self._jobs.clear()
        self._serials.clear()
        self._gen.close()
        self._backend.close()

    # ---- internals ----------------------------------------------------------------------

    def _check_size(self, prompt: int, new: int) -> None:
        limit = min(self.card.max_seq_len, self.total_pages * PAGE_TOKENS - RESERVED_TOKENS)
        if prompt + new > limit:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_tokens ({new}) = {prompt + new} tokens is over "
                f"this worker's limit of {limit} tokens (max sequence length and cache size)"
            )

    def _result(self, r: dict[str, Any]) -> StepOutput | None:
        serial = r.get("serial")
        tracked = self._jobs.get(serial) if isinstance(serial, int) else None
        if tracked is None:
            return None
        stage = r.get("stage")
        if stage == "error":
            self._forget(tracked)
            return error_output(r, tracked.job)
        if stage != "streaming":
            return None
        if r.get("eos"):
            self._forget(tracked)
        return streaming_output(r, tracked.job, tracked.prompt_tokens, self._backend.piece)

    def _forget(self, tracked: _Tracked) -> None:
        serial = self._serials.pop(tracked.job.id)
        del self._jobs[serial]
