"""A job's `logit_bias` and `min_tokens` on the GPU engines: applied to the step's logits on
the device, for every row at once, in the same hook as the constraint masks
(worker/dyngen/masks.py), before anything samples them.

Handed to the library instead, each would take its job off genq's batched sampling pass:
exllamav2 samples a job with a `token_bias` or a `min_new_tokens` on its CPU sampler (and a
step with one such job copies every row's logits to the host), exllamav3 gives such a job its
own `ComboSampler` and a per-job logit mask built on the host. So where the generator carries
genq's hook (`genq_edits`), the engine keeps both out of what the library is given
(`for_library`) and marks the library's job instead (`attach`):

- `genq_bias`: the bias's token ids and values, added to the job's row;
- `genq_min_tokens` and `genq_stop_ids`: while the job has generated fewer tokens than its
  minimum (`new_tokens`, the library's own count), its stop tokens (the model's EOS and the
  job's `stop_token_ids`, what the library's `min_new_tokens` blocks) get `MASKED`.

Each decode step `StepEdits.apply` finds those rows in the generator's row order (each active
job whose prefill is done, one row per sequence: `edit_rows`) and edits them in place with at
most two indexed writes, their indices in one pinned copy each; nothing waits for the device.
Whatever samples the row then sees the edited logits: genq's batched pass, exllamav2's CPU
sampler, exllamav3's own sampler (a job's first token, penalties, logprobs) alike. Stop
strings are not blocked before the minimum (nor are they by the libraries).

Imports torch only inside `StepEdits`; the rest is plain Python and tested on a CPU install.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.schemas import Sampling
from worker.dyngen.masks import MASKED


def for_library(s: Sampling) -> Sampling:
    """`s` as the library gets it when genq applies the bias and the minimum itself."""
    if not s.logit_bias and not s.min_tokens:
        return s
    return s.model_copy(update={"logit_bias": {}, "min_tokens": 0})


def attach(job: Any, s: Sampling, stop_ids: Sequence[int], vocab_size: int | None = None) -> None:
    """Mark the library's `job` with what `StepEdits` applies for `s` (its minimum counted
    from the job's first new token: the engine passes what an earlier attempt left);
    token ids at or past `vocab_size` (no token of the model) are dropped."""
    if s.logit_bias:
        pairs = sorted((int(k), float(v)) for k, v in s.logit_bias.items())
        pairs = [(t, v) for t, v in pairs if vocab_size is None or t < vocab_size]
        if pairs:
            job.genq_bias = ([t for t, _ in pairs], [v for _, v in pairs])
    if s.min_tokens:
        ids = sorted({int(t) for t in stop_ids if vocab_size is None or int(t) < vocab_size})
        if ids:
            job.genq_min_tokens = s.min_tokens
            job.genq_stop_ids = ids


@dataclass
class EditRows:
    bias: list[tuple[int, Any]] = field(default_factory=list)
    """(row, job) of each job with a bias, in row order."""
    blocked: list[tuple[int, Any]] = field(default_factory=list)
    """(row, job) of each job still short of its minimum, in row order."""
    total_rows: int = 0

    def __bool__(self) -> bool:
        return bool(self.bias or self.blocked)


def edit_rows(active_jobs: Iterable[Any]) -> EditRows:
    """The rows of this decode step in the order both generators stack them, and which of
    them `StepEdits` edits."""
    out = EditRows()
    for job in active_jobs:
        if not job.is_prefill_done():
            continue
        row = out.total_rows
        if getattr(job, "genq_bias", None) is not None:
            out.bias.append((row, job))
        if job.new_tokens < getattr(job, "genq_min_tokens", 0):
            out.blocked.append((row, job))
        out.total_rows += len(job.sequences)
    return out


class StepEdits:
    """One generator's edits (installed with its sampling hook); counts what it did."""

    def __init__(self) -> None:
        self.steps = 0
        """Decode steps with edited rows."""
        self.biased_rows = 0
        self.blocked_rows = 0
        self.missed = 0
        """Steps with rows to edit whose logits were not one decode position per row: left
        alone (genq runs no draft model, so a decode step is always one)."""
        self.seconds = 0.0
        """Host time in `apply`."""

    def warm_up(self, logits: Any) -> None:
        """Both edits once, on every row of `logits` (rows × 1 × vocabulary, on the device;
        overwritten): their kernels and pinned copies before the first real step. Counts
        nothing."""
        width = int(logits.shape[-1])
        jobs = [_Dummy(min(1, width - 1)) for _ in range(int(logits.shape[0]))]
        counters = (self.steps, self.biased_rows, self.blocked_rows, self.missed, self.seconds)
        self.apply(logits, jobs)
        self.steps, self.biased_rows, self.blocked_rows, self.missed, self.seconds = counters

    def profile(self) -> dict[str, float | int]:
        return {
            "edit_steps": self.steps,
            "biased_rows": self.biased_rows,
            "blocked_rows": self.blocked_rows,
            "edit_missed": self.missed,
            "edit_s": round(self.seconds, 6),
        }

    def apply(self, logits: Any, active_jobs: Iterable[Any]) -> None:
        """Edit the rows of `logits` (rows × 1 × vocabulary, on the device) in place."""
        started = time.perf_counter()
        plan = edit_rows(active_jobs)
        if not plan:
            return
        if logits.dim() != 3 or logits.shape[1] != 1 or plan.total_rows != logits.shape[0]:
            self.missed += 1
            return
        rows = logits[:, 0, :]
        width = int(logits.shape[-1])
        if plan.bias:
            index, values = _bias(plan.bias, width)
            device = logits.device
            index, values = _to(index, device), _to(values, device).to(logits.dtype)
            rows.index_put_((index[0], index[1]), values, accumulate=True)
            self.biased_rows += len(plan.bias)
        if plan.blocked:
            import torch

            index = _to(_stops(plan.blocked, width), logits.device)
            # filled on the device: a value copied there from the host would wait for the pass
            masked = torch.full((1,), MASKED, dtype=logits.dtype, device=logits.device)
            rows.index_put_((index[0], index[1]), masked)
            self.blocked_rows += len(plan.blocked)
        self.steps += 1
        self.seconds += time.perf_counter() - started


class _Dummy:
    """A job short of its minimum, with a bias, for `StepEdits.warm_up`."""

    new_tokens = 0
    genq_min_tokens = 1
    sequences = (None,)

    def __init__(self, token: int) -> None:
        self.genq_stop_ids = [token]
        self.genq_bias = ([token], [1.0])

    def is_prefill_done(self) -> bool:
        return True


def _bias(rows: list[tuple[int, Any]], width: int) -> tuple[Any, Any]:
    """(2 × n row and column indices, n values) of the biases of `rows`, from each job's
    tensors (made at its first step and kept on the job)."""
    import torch

    cols, vals, lengths = [], [], []
    for _, job in rows:
        cached = getattr(job, "genq_bias_t", None)
        if cached is None:
            ids, values = job.genq_bias
            c = torch.tensor(ids, dtype=torch.long)
            keep = c < width
            cached = job.genq_bias_t = (c[keep], torch.tensor(values, dtype=torch.float)[keep])
        cols.append(cached[0])
        vals.append(cached[1])
        lengths.append(int(cached[0].shape[0]))
    row = torch.repeat_interleave(
        torch.tensor([r for r, _ in rows], dtype=torch.long), torch.tensor(lengths)
    )
    return torch.stack([row, torch.cat(cols)]), torch.cat(vals)


def _stops(rows: list[tuple[int, Any]], width: int) -> Any:
    """2 × n row and column indices of the stop tokens of `rows`."""
    import torch

    cols, lengths = [], []
    for _, job in rows:
        cached = getattr(job, "genq_stop_t", None)
        if cached is None:
            c = torch.tensor(job.genq_stop_ids, dtype=torch.long)
            cached = job.genq_stop_t = c[c < width]
        cols.append(cached)
        lengths.append(int(cached.shape[0]))
    row = torch.repeat_interleave(
        torch.tensor([r for r, _ in rows], dtype=torch.long), torch.tensor(lengths)
    )
    return torch.stack([row, torch.cat(cols)])


def _to(t: Any, device: Any) -> Any:
    """`t` on `device`, through pinned memory (a pageable copy would wait for the pass)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
