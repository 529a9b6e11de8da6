"""The boundary between the worker and an engine (sim, exllamav2, exllamav3).

An engine is owned by one thread: in its engine process (worker/engine_process.py, the
default) or, for tests, a thread of the worker (worker/runner.py). Only that thread calls
anything on it after construction; the worker's I/O side sees the engine through an
`EngineLink` (worker/link.py), which keeps its own copy of what admission needs.

How an engine plugs in:
1. A class with the members of `Engine` below. `card` and `tokenizer_json` are read once,
   after construction; `page_size`, `total_pages` and `max_batch` too. `free_pages()` is
   asked after every `add`, `cancel` and `step` and sent to the worker with the step's
   outputs: the worker admits jobs against it (worker/admission.py), never asking the engine.
   An engine that holds pages for more than prompt + max new tokens per job says how many
   tokens more in an optional `reserved_tokens` (exllamav3: 1; `reserved_tokens()` reads it).
   One that prefills its jobs side by side rather than one after another within its steps
   says so in an optional `prefill_side_by_side` (the sim without prefill chunks): the worker
   measures its pace of prefill for placement accordingly (worker/pace.py).
2. A branch in `worker.process.build_engine` that builds it from `EngineSettings` (import
   its library lazily there: a CPU install has no torch).
3. A `sampling_support` table (`SamplingSupport`): where it honours each sampler setting
   of `shared.schemas.Sampling`, or that it refuses one (a job setting it fails at add).
   tests/unit/test_sampling_support.py holds every engine's table to the whole list of
   settings, so a setting added to `Sampling` fails there until each engine maps it.
4. Nothing else: the engine process, the attempts, cancels, text (when the worker makes it)
   and failures are handled around it. `step` may raise: every job is failed (handed back
   for another attempt) and `reset` is called.

A job that fails in the engine is handed back for another attempt (on any worker), unless
the failure is the job's own: `add` raising `JobRefused`, or an output whose `error_code` is
set (its constraint cannot run: the same on every worker). Such a job fails at once with that
code; nothing is counted against this worker.

Jobs arrive with `EngineJob.text`: when False the worker makes the job's text from its token
ids and matches its stop strings itself (GENQ_DETOKENIZE=worker); the engine emits token ids
only, ignores `sampling.stop`, and stops on stop tokens and lengths alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from shared.schemas import SAMPLING_FIELD_SET, FinishReason, ModelCard, Sampling


@dataclass(slots=True)
class EngineJob:
    id: str
    input_ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    resume_ids: list[int] = field(default_factory=list)
    """Tokens already sent to the client by an earlier attempt: prefilled, not re-emitted."""
    text: bool = True
    """Whether the engine makes the text and matches `sampling.stop`; False: token ids only."""
    grammar: str | None = None
    """The job's constraint as an llguidance grammar (`JobSpec.constraint`): every token it
    generates is one the grammar allows, from the first (after `resume_ids`, which the engine
    replays into its matcher); the job ends when the grammar is complete."""


@dataclass(frozen=True)
class SamplingSupport:
    """How an engine honours each sampler setting (`shared.schemas.SAMPLING_FIELDS`): every
    setting is in exactly one of the three, and a test holds it so."""

    sampler: frozenset[str]
    """Settings its sampler mapping hands the library (exllamav2's sampler settings,
    exllamav3's `ComboSampler` arguments): a test checks that a change to each changes what
    the library is given."""
    elsewhere: Mapping[str, str]
    """Settings it honours outside that mapping: setting → where (stop conditions, logprobs)."""
    refused: frozenset[str] = frozenset()
    """Settings it cannot honour: a job that sets one off its default is refused at add."""
    per_job: Mapping[str, str] = field(default_factory=dict)
    """Settings it honours (in `sampler` or `elsewhere`) that take a job off genq's batched
    sampling pass, onto the library's own per-job sampler: setting → why it must. Every other
    setting leaves a job on the pass; tests/unit/test_batched_path.py holds the engine's
    actual decision to this, and docs/performance.md names each one's cost."""

    def __post_init__(self) -> None:
        named = [*self.sampler, *self.elsewhere, *self.refused]
        if len(named) != len(set(named)) or not set(named) <= SAMPLING_FIELD_SET:
            raise ValueError(f"a setting named twice, or no sampler setting, in {named}")
        honoured = set(self.sampler) | set(self.elsewhere)
        if not set(self.per_job) <= honoured:
            raise ValueError(f"per_job names settings the engine does not honour: {self.per_job}")

    @property
    def missing(self) -> frozenset[str]:
        """Settings the table does not name: none, once the engine is up to date."""
        return SAMPLING_FIELD_SET - self.sampler - set(self.elsewhere) - self.refused

    def check(self, s: Sampling) -> None:
        """ValueError naming the refused settings `s` sets off their defaults."""
        if not self.refused:
            return
        bad = [name for name in s.changed() if name in self.refused]
        if bad:
            raise ValueError(f"this engine does not support {', '.join(bad)}")


# The two structs below cross the engine process's socket (worker/wire.py): msgspec, encoded
# as arrays (field order is the format). gc=False: they never take part in a reference cycle,
# so the collector need not track the thousands a busy step makes.


class JobRefused(ValueError):
    """An engine's refusal of a job for what the job itself asks, not for this worker's state
    (its constraint does not build, or its tokens do not fit it): the job fails at once with
    `code`, and no other worker tries it."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Stop(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Why the worker stops a job in the engine. It travels with the cancel command and comes
    back on the job's last output, so the job ends the way it was stopped."""

    kind: Literal["cancelled", "expired", "dropped"]
    """cancelled: by its client (ends `cancelled`); expired: past its deadline (ends
    `expired`); dropped: the job left this worker (fenced, handed back) or ended here already
    (a stop string the worker matched): nothing to write."""
    reason: str = ""


class StepOutput(msgspec.Struct, array_like=True, gc=False):
    """What one engine step produced for one job."""

    job_id: str
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: FinishReason | None = None
    """Set when the job finished in the engine (stop token or string, or max tokens)."""
    error: str | None = None
    """Set when the engine failed this job: it is handed back for another attempt, unless
    `error_code` is set too."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    attempt: int = 0
    """The attempt this output belongs to (set around the engine, not by it)."""
    stopped: Stop | None = None
    """Set on the output that confirms a cancel (set around the engine, not by it)."""
    error_code: str | None = None
    """With `error`: the failure is the job's own (`shared.constraints.CONSTRAINT_FAILED`: its
    constraint cannot run), so the job fails at once with this code, on no other worker."""


class Engine(Protocol):
    card: ModelCard
    tokenizer_json: str
    sampling_support: SamplingSupport

    @property
    def max_batch(self) -> int: ...

    @property
    def page_size(self) -> int:
        """Tokens per cache page; 0: the engine counts no pages (batch slots alone limit it)."""
        ...

    @property
    def total_pages(self) -> int: ...

    def free_pages(self) -> int:
        """Pages a new job could take now: free ones less what jobs waiting inside the engine
        will take when they start. 0 when `page_size` is 0."""
        ...

    def add(self, job: EngineJob) -> None:
        """Start a job; raise (ValueError) to refuse it (it fails alone, with that message)."""
        ...

    def cancel(self, job_id: str) -> bool:
        """Stop a job and free its resources; True if it was running."""
        ...

    def step(self) -> list[StepOutput]:
        """Advance every active job by one step; block for at most one step's time."""
        ...

    def active(self) -> int: ...

    def reset(self) -> list[str]:
        """Drop every job after a failed step (rebuilding state if needed); their ids."""
        ...

    def close(self) -> None: ...


def reserved_tokens(engine: Engine) -> int:
    """Tokens `engine` holds per job beyond prompt + max new (0 unless it says otherwise)."""
    return int(getattr(engine, "reserved_tokens", 0))


def prefill_side_by_side(engine: Engine) -> bool:
    """Whether `engine` prefills its jobs side by side (False unless it says so): a GPU
    engine's steps prefill one job after another."""
    return bool(getattr(engine, "prefill_side_by_side", False))
