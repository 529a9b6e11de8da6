"""The batched sampling pass both engines can run after a decode step: every row it serves
sampled on the GPU in one pass over the step's logits, instead of a sampler call per job
(exllamav2's on the CPU, exllamav3's one kernel launch per job).

- `plan_rows` finds the rows of the step, in the order both generators stack them, and which
  of them the pass samples; each engine says which jobs it serves (`served`).
- `pick_on_device` samples them: one uniform draw from each job's own seeded RNG; temperature
  below `GREEDY_BELOW` or top_k = 1 is greedy (argmax); otherwise softmax(logits /
  temperature), then top_k, then top_p (the fewest most likely tokens whose mass, of what
  top_k kept, reaches top_p), then min_p (tokens at least min_p × the most likely one), then
  the token at which the cumulative mass passes the draw × the mass kept; its probability is
  its share of the kept mass.
- `ModelProxy` is where each engine hooks the pass in: its generator's model, one method
  wrapped.

Imports torch only inside `pick_on_device`; `RowParams` and `plan_rows` are plain Python and
tested on a CPU install.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

GREEDY_BELOW = 0.01
"""exllamav2's own rule: a temperature below this samples greedily (the pass keeps it on both
engines)."""


@dataclass(frozen=True)
class RowParams:
    temperature: float
    top_k: int
    top_p: float
    min_p: float

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def truncates(self) -> bool:
        return not self.greedy and (self.top_k > 1 or self.top_p < 1.0 or self.min_p > 0.0)


@dataclass
class Plan:
    rows: list[int]
    """Row of each sampled job in the step's logits."""
    jobs: list[Any]
    params: list[tuple[float, float, float, float, float]]
    """(temperature, top_k, top_p, min_p, uniform draw) per sampled job."""
    total_rows: int
    truncates: bool

    @property
    def every_row(self) -> bool:
        return len(self.rows) == self.total_rows


def plan_rows(active_jobs: Iterable[Any], served: Callable[[Any], bool]) -> Plan:
    """The rows of this decode step, in the order the generator stacks them (each active job
    whose prefill is done, one row per sequence), and which of them are sampled here (those
    with `genq_params` that `served` takes this step). Draws each sampled job's uniform from
    its own RNG, as the CPU sampler would."""
    out = Plan([], [], [], 0, False)
    for job in active_jobs:
        if not job.is_prefill_done():
            continue
        p: RowParams | None = getattr(job, "genq_params", None)
        if p is not None and served(job):
            out.rows.append(out.total_rows)
            out.jobs.append(job)
            out.params.append((p.temperature, p.top_k, p.top_p, p.min_p, job.rng.random()))
            out.truncates = out.truncates or p.truncates
        out.total_rows += len(job.sequences)
    return out


def pick_on_device(logits: Any, params: Sequence[tuple[float, ...]], truncates: bool) -> Any:
    """Tokens, (n, 1) int64, and their probabilities, (n, 1) float32, for `logits` (rows ×
    vocabulary, on the GPU), one row per entry of `params`; left on the device (nothing
    waits for them)."""
    import torch

    dev = logits.device
    p = torch.tensor(params, dtype=torch.float32)
    if dev.type != "cpu":
        p = p.pin_memory().to(dev, non_blocking=True)
    temp, top_k, top_p, min_p, u = (c[:, None] for c in p.unbind(1))
    greedy = (temp < GREEDY_BELOW) | (top_k == 1)
    x = logits.float()
    best = x.argmax(-1, keepdim=True)
    probs = torch.softmax(x / torch.where(greedy, 1.0, temp), dim=-1)
    order = None
    if truncates:
        probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=dev)[None, :]
        keep = (top_k <= 0) | (rank < top_k)
        kept = probs * keep
        cum = kept.cumsum(-1)
        keep &= (top_p >= 1.0) | (cum - kept < top_p * cum[:, -1:])
        keep &= probs >= min_p * probs[:, :1]
        keep[:, 0] = True
        probs = probs * keep
    cdf = probs.cumsum(-1)
    mass = cdf[:, -1:]
    at = torch.searchsorted(cdf, u * mass).clamp_(max=probs.shape[-1] - 1)
    token = at if order is None else order.gather(1, at)
    token = torch.where(greedy, best, token)
    prob = torch.where(greedy, 1.0, probs.gather(1, at) / mass)
    return token, prob


class ModelProxy:
    """A generator's model with one method wrapped (by a subclass); everything else is the
    model's own. Both engines' sampling hooks sit there."""

    def __init__(self, model: Any, sampler: Any) -> None:
        self._model = model
        self._sampler = sampler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
