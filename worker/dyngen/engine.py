"""`DynamicEngine`: genq's `Engine` protocol over a dynamic generator, what the exllamav2 and
exllamav3 engines share.

It talks to the generator through the few methods and attributes both libraries have
(`enqueue`, `cancel`, `iterate`, `pending_jobs`, `max_batch_size`, a job's
`current_new_pages_required()`), so CPU tests drive it with a fake generator. A subclass says
what differs: the key a result names its job by (`_enqueue`), the generator's pages
(`page_size`, `total_pages`, `_unreferenced_pages`), the most tokens a job may hold
(`_token_limit`), how a result dict reads (`_result`), and what a generator needs when it is
dropped (`_drop_generator`, `_close_generator`).

Admission is the worker's (worker/admission.py): the engine reports its free pages after each
call that changes them (`free_pages`).

A job's `logit_bias` and `min_tokens` are applied by genq's hook on the step's logits, for
every row at once, where the generator has it (`genq_edits`): the library's job gets neither
(worker/dyngen/edits.py), so neither takes the job off genq's batched sampling pass.

Constrained jobs (`EngineJob.grammar`): `add` gives the library's job an llguidance matcher
(`genq_matcher`, from the engine's `Grammars`: its tokenizer, the card's EOS ids, the model's
logits width) advanced over the tokens an earlier attempt generated; the generator's hook masks
each step's logits and the job feeds its matcher (worker/dyngen/masks.py). A job whose token
its grammar refused (`genq_failed`; a matcher that failed allows EOS alone, and refuses it) is
failed by `step` before that step's output of it goes out, even where that token ended it in
the generator: with `constraint_failed`, the job's own fault, as is a constraint that does not
build or replay at `add`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from shared.constraints import CONSTRAINT_FAILED
from shared.schemas import ModelCard
from worker.constraint import ConstraintError, Grammars, JobMatcher
from worker.dyngen.backend import Backend
from worker.dyngen.edits import attach, for_library
from worker.engine import EngineJob, StepOutput

UNCONSTRAINED_ONLY = ("min_tokens", "banned_strings")
"""Sampler settings a constrained job may not set on these engines: both libraries end a
banned string by rewinding the job's tokens (its matcher has taken them already), and a
minimum of tokens blocks the EOS that a complete grammar allows alone."""


@dataclass
class Tracked:
    job: EngineJob
    handle: Any
    prompt_tokens: int


class DynamicEngine(ABC):
    def __init__(self, backend: Backend, card: ModelCard, tokenizer_json: str) -> None:
        self._backend = backend
        self.card = card
        self.tokenizer_json = tokenizer_json
        self._gen = backend.make_generator()
        self._max_batch = min(card.max_batch, int(self._gen.max_batch_size))
        self._jobs: dict[Hashable, Tracked] = {}
        """By the key every result names its job by (`_enqueue`)."""
        self._keys: dict[str, Hashable] = {}
        """Job id → its key in `_jobs`."""
        self._ready: list[StepOutput] = []
        self._grammars: Grammars | None = None
        """Built at the first constrained job (many workers never see one)."""
        self._constrained: dict[str, Any] = {}
        """The tracked jobs with a matcher: id → the library's job."""

    # ---- what a subclass says -----------------------------------------------------------

    @property
    @abstractmethod
    def page_size(self) -> int: ...

    @property
    @abstractmethod
    def total_pages(self) -> int: ...

    @abstractmethod
    def _unreferenced_pages(self) -> int: ...

    @abstractmethod
    def _token_limit(self) -> int:
        """Most tokens (prompt + max new) one job may take."""
        ...

    @abstractmethod
    def _enqueue(self, handle: Any, job_id: str) -> Hashable:
        """Hand the job to the generator; the key its results will name it by."""
        ...

    @abstractmethod
    def _result(self, r: dict[str, Any]) -> StepOutput | None:
        """What one result dict of `iterate()` says, or None; `_forget`s a job that ended."""
        ...

    def _drop_generator(self) -> None:  # noqa: B027 (optional: exllamav2's needs nothing)
        """After a failed step, before a new generator replaces the current one."""

    def _close_generator(self) -> None:  # noqa: B027 (optional: exllamav2's needs nothing)
        """On close, after every job was cancelled."""

    # ---- protocol -----------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def free_pages(self) -> int:
        """Pages no job holds (prefix-cache pages count as free: the generator reuses them),
        less what jobs waiting inside the generator will take when they start."""
        waiting: int = sum(j.current_new_pages_required() for j in list(self._gen.pending_jobs))
        return self._unreferenced_pages() - waiting

    def add(self, job: EngineJob) -> None:
        ids = [*job.input_ids, *job.resume_ids]
        remaining = job.max_tokens - len(job.resume_ids)
        self._check_size(len(ids), max(remaining, 0))
        if remaining <= 0:  # an earlier attempt sent everything but the end
            self._ready.append(
                StepOutput(job.id, finish_reason="length", prompt_tokens=len(job.input_ids))
            )
            return
        matcher = self._matcher(job)
        if matcher is not None and matcher.stopped:  # the earlier attempt completed its grammar
            self._ready.append(
                StepOutput(job.id, finish_reason="stop", prompt_tokens=len(job.input_ids))
            )
            return
        stop_ids = [*self.card.eos_token_ids, *job.sampling.stop_token_ids]
        stops: list[int | str] = [*stop_ids]
        if job.text:  # else the worker matches stop strings in the text it makes
            stops += job.sampling.stop
        sampling = job.sampling
        if sampling.min_tokens and job.resume_ids:  # counted from the job's first token
            left = max(sampling.min_tokens - len(job.resume_ids), 0)
            sampling = sampling.model_copy(update={"min_tokens": left})
        edited = getattr(self._gen, "genq_edits", None) is not None
        library = for_library(sampling) if edited else sampling
        handle = self._backend.make_job(ids, remaining, library, job.seed, stops, job.id)
        if library is not sampling:  # genq's hook applies the bias and the minimum
            attach(handle, sampling, stop_ids, self._backend.vocab_size)
        if matcher is not None:
            handle.genq_matcher = matcher
            self._constrained[job.id] = handle
        key = self._enqueue(handle, job.id)
        self._jobs[key] = Tracked(job, handle, len(job.input_ids))
        self._keys[job.id] = key

    def cancel(self, job_id: str) -> bool:
        key = self._keys.pop(job_id, None)
        if key is None:
            before = len(self._ready)
            self._ready = [o for o in self._ready if o.job_id != job_id]
            return len(self._ready) < before
        tracked = self._jobs.pop(key)
        self._constrained.pop(job_id, None)
        self._gen.cancel(tracked.handle)
        return True

    def step(self) -> list[StepOutput]:
        outputs, self._ready = self._ready, []
        if self._jobs:
            watched = dict(self._constrained)  # a job the step ends leaves `_constrained`
            results = self._gen.iterate()
            if watched:  # the step's tokens into their matchers (those of jobs it ended too)
                self._gen.genq_masks.consume()
            outputs += [o for r in results if (o := self._result(r)) is not None]
            if watched:
                outputs = self._fail_refused(outputs, watched)
        return outputs

    def profile(self) -> dict[str, float | int]:
        """The current generator's hook counters (totals so far): what genq's edits, masks
        and batched pass cost its steps; empty without the hook."""
        out: dict[str, float | int] = {}
        for name in ("genq_edits", "genq_masks", "genq_sampler"):
            part = getattr(getattr(self._gen, name, None), "profile", None)
            if callable(part):
                out.update(part())
        return out

    def active(self) -> int:
        return len(self._jobs) + len(self._ready)

    def reset(self) -> list[str]:
        ids = [*self._keys, *(o.job_id for o in self._ready)]
        self._jobs.clear()
        self._keys.clear()
        self._ready.clear()
        self._constrained.clear()
        self._drop_generator()
        self._gen = self._backend.make_generator()
        return ids

    def close(self) -> None:
        for tracked in self._jobs.values():
            self._gen.cancel(tracked.handle)
        self._jobs.clear()
        self._keys.clear()
        self._constrained.clear()
        self._close_generator()
        self._backend.close()

    # ---- internals ----------------------------------------------------------------------

    def _check_size(self, prompt: int, new: int) -> None:
        limit = self._token_limit()
        if prompt + new > limit:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_tokens ({new}) = {prompt + new} tokens is over "
                f"this worker's limit of {limit} tokens (max sequence length and cache size)"
            )

    def _forget(self, tracked: Tracked) -> None:
        """A job that ended in the generator: no longer tracked."""
        del self._jobs[self._keys.pop(tracked.job.id)]
        self._constrained.pop(tracked.job.id, None)

    def _matcher(self, job: EngineJob) -> JobMatcher | None:
        """The job's matcher, replayed over its `resume_ids`, or None for a job without a
        constraint. ValueError (handed back: another worker may) where this worker cannot
        apply constraints; ConstraintError (the job's fault: it fails) where the job's
        constraint cannot run."""
        if job.grammar is None:
            return None
        if getattr(self._gen, "genq_masks", None) is None:
            raise ValueError("this worker cannot apply constraints: its generator has no mask hook")
        if not self.card.eos_token_ids:
            raise ValueError("this worker cannot apply constraints: its model names no EOS token")
        clash = [name for name in UNCONSTRAINED_ONLY if name in job.sampling.changed()]
        if clash:
            raise ConstraintError(f"{' and '.join(clash)} cannot be combined with a constraint")
        if self._grammars is None:
            eos = self.card.eos_token_ids
            self._grammars = Grammars(self.tokenizer_json, eos, self._backend.vocab_size)
        return self._grammars.matcher(job.grammar, job.resume_ids)

    def _fail_refused(self, outputs: list[StepOutput], watched: dict[str, Any]) -> list[StepOutput]:
        """Fail the jobs (of `watched`: the constrained ones before the step) whose last token
        their grammar refused (`genq_failed`): out of the generator if the step left them
        there, their outputs of this step replaced by the error."""
        failed: dict[str, str] = {}
        for job_id, handle in watched.items():
            why = getattr(handle, "genq_failed", None)
            if not why:
                continue
            key = self._keys.get(job_id)
            if key is not None and self._jobs[key].handle is handle:
                self._gen.cancel(handle)
                self._forget(self._jobs[key])
            failed[job_id] = why
        if not failed:
            return outputs
        kept = [o for o in outputs if o.job_id not in failed]
        return kept + [
            StepOutput(job_id, error=f"the constraint failed: {why}", error_code=CONSTRAINT_FAILED)
            for job_id, why in failed.items()
        ]
