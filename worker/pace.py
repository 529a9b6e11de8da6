"""How soon this worker could start one more job, as placement weighs it against the prefill a
cached prefix saves (gateway/placement.py): its engine's prefill rate and the prefill still
queued, and how long a job holds its slot. Measured here from what every engine reports (a
job's start, its first token, its end), so no engine needs a call of its own.

The prefill rate is the prompt tokens the engine prefilled over the time it spent on them. A
GPU engine prefills one job after another within its steps: a job's prefill time is from its
first token back to the previous job's (or to its start, if none was waiting), and a new job
waits for the backlog, the prompt tokens of jobs started before it, first. An engine that
prefills jobs side by side (`worker.engine.prefill_side_by_side`: the sim, by default) has no
backlog, and a job's prefill time is from its start. Recent jobs weigh most (each new one
takes `WEIGHT` of the figure).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

WEIGHT = 0.1
"""The share of a figure each new measurement takes (the rest is what came before)."""


@dataclass
class Pace:
    side_by_side: bool = False
    """The engine prefills its jobs side by side, not one after another."""
    tokens: float = 0.0
    """Prompt tokens prefilled, recent ones weighing most."""
    seconds: float = 0.0
    """The time they took (while any prefill was waiting), weighed alike."""
    job_s: float = 0.0
    """How long a job holds its slot, start to end, recent ones weighing most."""
    _pending: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Job → (prompt tokens it has to prefill, when it started), until its first token."""
    _backlog: int = 0
    _since: float = 0.0
    """When the prefill time counted last ran up to."""

    def started(self, job_id: str, uncached: int) -> None:
        """A job went to the engine with `uncached` prompt tokens to prefill."""
        now = time.monotonic()
        if not self._pending:
            self._since = now
        self._pending[job_id] = (uncached, now)
        self._backlog += uncached

    def first_token(self, job_id: str) -> None:
        """The job's prompt is prefilled."""
        entry = self._pending.pop(job_id, None)
        if entry is None:
            return
        tokens, started = entry
        self._backlog -= tokens
        now = time.monotonic()
        took = now - (started if self.side_by_side else self._since)
        self.tokens = self.tokens * (1 - WEIGHT) + tokens * WEIGHT
        self.seconds = self.seconds * (1 - WEIGHT) + took * WEIGHT
        self._since = now

    def ended(self, job_id: str, held_s: float | None) -> None:
        """The job left the engine: ended after `held_s` seconds there, or (None) failed,
        dropped or handed back, which says nothing of how long jobs take."""
        entry = self._pending.pop(job_id, None)
        if entry is not None:
            self._backlog -= entry[0]
            return
        if held_s is not None:
            held = max(0.0, held_s)
            self.job_s = held if not self.job_s else self.job_s * (1 - WEIGHT) + held * WEIGHT

    def prefill_tps(self) -> float:
        """Prompt tokens a second the engine prefills; 0 until a job has shown it."""
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens > 0 else 0.0

    def backlog(self) -> int:
        """Prompt tokens a job starting now waits for: those of jobs started here and not
        prefilled yet (none for an engine that prefills side by side)."""
        return 0 if self.side_by_side else max(0, self._backlog)
