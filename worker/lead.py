"""How far ahead of their slots batch claims start (worker/claims.py): the steps that a claim
takes from the queue to the engine's doorstep, measured.

A batch claim taken for a slot about to come free must be read (XREADGROUP), STARTed (one
script per job, pipelined) and begun (its spec parsed, sent to the engine) before the step
that frees the slot ends, or the slot idles until it arrives. For jobs of a few tokens that
is most of their life: a 4-token job holds its slot four steps, and 240 STARTs in one pipeline
took 45-90 ms on the 2-core box, three to four 20 ms steps. A fixed lead of two tokens left
the engine idle 60 % of the time between cohorts of such jobs. So the lead is the claim's way
in steps, measured here (recent ones weighing most), plus the flush that the step's outputs may
wait for before the worker reads them, plus one step for the message that tells the worker of
the step: between `MIN_TOKENS` and `MAX_TOKENS`.

Starting ahead costs nothing but the claims' earlier start: they wait at the doorstep
(worker/core.py), at most one per slot that frees within the lead and the next group's START
(a job at the doorstep counts once it would join and end within it too), never more than two
batch slots' worth; only batch claims, beside an interactive reserve, start ahead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TOKENS = 2
"""The lead before anything is measured, and the least: a job within two tokens of its end."""
MAX_TOKENS = 8
"""The most: past it, claims would wait at the doorstep longer than they save."""
WEIGHT = 0.2
"""The share of a figure each new measurement takes."""


@dataclass(slots=True)
class Lead:
    read_s: float = 0.0
    """How long a claim read takes."""
    start_s: float = 0.0
    """How long STARTing and beginning a group of claims takes."""
    flush_s: float = 0.0
    """How long a flush takes: a step's outputs that come meanwhile are read after it, so the
    worker learns that a job nears its end up to a flush late."""

    def read(self, seconds: float) -> None:
        self.read_s = mix(self.read_s, seconds)

    def started(self, seconds: float) -> None:
        self.start_s = mix(self.start_s, seconds)

    def flushed(self, seconds: float) -> None:
        self.flush_s = mix(self.flush_s, seconds)

    def tokens(self, step_s: float) -> int:
        """How many tokens before its end a running batch job's slot is claimed for, where
        the engine steps every `step_s` seconds (`StepTimes.recent_s`)."""
        if step_s <= 0:
            return MIN_TOKENS
        way = math.ceil((self.read_s + self.start_s + self.flush_s) / step_s) + 1
        return max(MIN_TOKENS, min(MAX_TOKENS, way))

    def start_steps(self, step_s: float) -> int:
        """Steps one group of STARTs takes: the next group can start no sooner (a claimer
        STARTs one group at a time), so claims started now cover the slots that free until
        then too."""
        return math.ceil(self.start_s / step_s) if step_s > 0 else 0


def mix(old: float, new: float) -> float:
    return new if old <= 0 else old * (1 - WEIGHT) + new * WEIGHT
