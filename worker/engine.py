"""The boundary between the worker loop and an engine (sim, exllamav2, exllamav3).

An engine is owned by one thread (the runner); only that thread calls `add`, `cancel` and
`step`. `free_slots` and `card` may be read from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from shared.schemas import FinishReason, ModelCard, Sampling


@dataclass(slots=True)
class EngineJob:
    id: str
    input_ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    resume_ids: list[int] = field(default_factory=list)
    """Tokens already sent to the client by an earlier attempt: prefilled, not re-emitted."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Why the worker stops a job in the engine. It travels with the cancel command and comes
    back on the job's last output, so the job ends the way it was stopped."""

    kind: Literal["cancelled", "expired", "dropped"]
    """cancelled: by its client (ends `cancelled`); expired: past its deadline (ends
    `expired`); dropped: the job left this worker (fenced, handed back): nothing to write."""
    reason: str = ""


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one job."""

    job_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: FinishReason | None = None
    """Set when the job finished in the engine (stop token or string, or max tokens)."""
    error: str | None = None
    """Set when the engine failed this job; the job ends (or is retried) with an error."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    attempt: int = 0
    """The attempt this output belongs to (set by the runner, not the engine)."""
    stopped: Stop | None = None
    """Set by the runner on the output that confirms a `cancel`."""


class Engine(Protocol):
    card: ModelCard
    tokenizer_json: str

    @property
    def max_batch(self) -> int: ...

    def fits(self, need_tokens: int, active: int) -> bool:
        """Whether a job of `need_tokens` (prompt + max new) could start now beside `active`."""
        ...

    def add(self, job: EngineJob) -> None: ...

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
