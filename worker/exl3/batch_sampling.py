"""Batched sampling for the exllamav3 engine (`GENQ_BATCHED_SAMPLING`).

exllamav3 samples each job on the GPU, but one job at a time: after every decode pass its
generator calls each job's `receive_logits`, which launches that job's `ComboSampler` (a
masking fill, then its fused kernel) from Python. The bare loop's probe (`genq.benchgpu
--sampler-probe`, docs/performance.md) measured those launches at 3.4 ms of a
31.8 ms step at 64 streams on the EXL3 8B: 10.7 % of the step, growing with the batch.

With this on, genq samples the jobs it can in one batched pass instead, the one exllamav2's
engine uses too (`worker/dyngen/batch_pass.py`, `pick_on_device`), and hands each job its
token:

- `install(generator)` wraps the generator's model (`_SamplingModel`): after each decode
  forward pass (the one `iterate` makes with `pinned_staging`), `plan()` finds the rows of the
  jobs this serves, in the generator's own row order (each active job whose prefill is done,
  one row per sequence), and one pass picks their tokens. One copy puts them in a pinned host
  buffer, queued behind the pass; the generator's own synchronize, before it reads any job's
  token, waits for it.
- Jobs are made with `job_class()`, a subclass of exllamav3's `Job` whose `receive_logits`
  returns that token instead of launching its sampler.

What stays on exllamav3's own sampler (per job): repetition, presence and frequency
penalties, logprobs, banned strings (the engine's `SamplingSupport.per_job` names them), and
every job's first token (exllamav3 checks the first logits for
NaN and infinity there; token healing and forced tokens happen there too). So does every job
of a decode pass that would serve fewer than `min_jobs` of them (`GENQ_BATCHED_SAMPLING_MIN_JOBS`,
default 16): the pass's host time is mostly fixed (0.54 ms a step at one stream, 1.47
at 64 on an H200) and one job's own launches cost ~0.05 ms, so below ~14 jobs the launches are
cheaper; on the fp16 8B, where one stream's step is bound by launching kernels, the worker did
1.03-1.09 x the tokens/s with exllamav3's own sampler at one stream (docs/performance.md).
Below it a job's tokens are exactly what `GENQ_BATCHED_SAMPLING=false` gives (its RNG is not
drawn from for the pass); a job whose steps cross the line changes sampler there: the same
distribution (below), its draws from the same seeded RNG.

Semantics on this path are the batched pass's (`worker/dyngen/batch_pass.py`): one uniform
draw from the job's own seeded RNG per token; temperature below 0.01 or top_k = 1 is greedy;
otherwise temperature, then top_k, then top_p, then min_p, then the draw: the same
distribution on either engine. exllamav3's own ComboSampler truncates by min_p before top_k
and top_p, so with min_p and one of the others set the two can keep different tokens.

A job's logit bias and minimum of new tokens are not handed to exllamav3 (its `ComboSampler`'s
`logit_bias` and the job's `min_new_tokens` would keep it off this pass): the same hook adds
the bias and masks the stop tokens of the rows still short of their minimum on the device,
for every row at once, before anything samples them (worker/dyngen/edits.py).

Constrained jobs (worker/dyngen/masks.py): the same hook masks their rows of the logits on the
device first, whether or not this pass then samples them (exllamav3's own sampler reads the
same, masked, logits); their masks are started just before the decode pass
(`StepMasks.start`), so llguidance computes them while the pass is launched and runs. The
hook is installed with batched sampling off too (`install(..., batched=False)`), editing and
masking alone. The job queues each token it takes for its matcher in `receive_sample`, after
the generator's synchronize; the engine has them consumed after the step.

This module imports torch and exllamav3 only inside functions, so it loads on a CPU install;
`row_params`, `plan` and `take` are plain Python and tested there.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from typing import Any

from shared.schemas import Sampling
from worker.dyngen.batch_pass import ModelProxy, Plan, RowParams, pick_on_device, plan_rows
from worker.dyngen.edits import StepEdits
from worker.dyngen.masks import StepMasks

log = logging.getLogger(__name__)


PASS_APPLIES = frozenset({"temperature", "top_k", "top_p", "min_p"})
"""Sampler settings the batched pass applies itself (`RowParams`)."""
PASS_LEAVES = frozenset({"seed", "stop", "stop_token_ids"})
"""Sampler settings the pass leaves where they are: the job's own seeded RNG, which it draws
from, and the generator's stop conditions."""


def row_params(s: Sampling) -> RowParams | None:
    """How the batched pass serves a job with these settings, or None: exllamav3's sampler,
    for a job that sets any other setting off its default (penalties, logprobs, and any
    setting the pass was not written for)."""
    if any(name not in PASS_APPLIES and name not in PASS_LEAVES for name in s.changed()):
        return None
    return RowParams(s.temperature, s.top_k, s.top_p, s.min_p)


def served_this_step(job: Any) -> bool:
    """A job with `genq_params` takes its token from the pass from its second token on (the
    first keeps exllamav3's NaN check, and token healing), with one sequence, no forced
    tokens and no filters."""
    return (
        len(job.sequences) == 1
        and job.new_tokens >= 1
        and job.forced_ids is None
        and not job.filters
    )


def plan(active_jobs: Iterable[Any]) -> Plan:
    """The rows of this decode pass in the order exllamav3's `iterate_gen` stacks them (as
    exllamav2's generator does), and which of them the batched pass samples."""
    return plan_rows(active_jobs, served_this_step)


def serves_at_least(active_jobs: Iterable[Any], n: int) -> bool:
    """Whether `plan` would sample at least `n` of these jobs; counts without drawing from
    their RNGs (exllamav3's own sampler draws from the same one) and stops at `n`."""
    count = 0
    for job in active_jobs:
        if count >= n:
            break
        served = getattr(job, "genq_params", None) is not None and served_this_step(job)
        if served and job.is_prefill_done():
            count += 1
    return count >= n


def take(job: Any) -> Any | None:
    """The token the last decode pass sampled for `job` in the batch, or None (then the job
    samples itself); either way the job's hand-off is cleared."""
    picked, job.genq_next = job.genq_next, None
    sampler = getattr(job.generator, "genq_sampler", None)
    if picked is None or sampler is None or picked[0] != sampler.step:
        return None
    return picked[1]


class BatchSampler:
    """Installed on one generator by `install`; counts what it sampled. `batched` False: the
    hook masks constrained rows (`masks`) and leaves every job to its own sampler."""

    def __init__(
        self,
        generator: Any,
        min_jobs: int = 1,
        masks: StepMasks | None = None,
        batched: bool = True,
        edits: StepEdits | None = None,
    ) -> None:
        self.gen = generator
        self.min_jobs = min_jobs
        self.masks = masks
        self.edits = edits or StepEdits()
        self.batched = batched
        self.vocab = int(generator.tokenizer.actual_vocab_size)
        self._host: Any = None
        """The sampled tokens' host buffer (pinned beside a GPU), one row per job."""
        self.step = 0
        """Decode passes seen; a job takes a token only from the pass it was sampled in."""
        self.batched_tokens = 0
        self.seconds = 0.0
        """Host time in `after_decode` (the plan and the pass's launches): what the pass costs
        the step, against the per-job launches it replaces."""

    def profile(self) -> dict[str, float | int]:
        return {
            "batched_tokens": self.batched_tokens,
            "passes": self.step,
            "batched_pass_s": round(self.seconds, 6),
        }

    def before_decode(self) -> None:
        """Before the decode pass: its constrained rows' masks, on their thread meanwhile."""
        if self.masks is not None:
            self.masks.start(self.gen.active_jobs)

    def after_decode(self, logits: Any) -> None:
        started = time.perf_counter()
        try:
            self._sample(logits)
        finally:
            self.seconds += time.perf_counter() - started

    def _sample(self, logits: Any) -> None:
        self.step += 1
        if logits.dim() != 3 or logits.shape[1] != 1:
            return
        jobs = self.gen.active_jobs
        self.edits.apply(logits, jobs)
        if self.masks is not None:
            self.masks.apply(logits, jobs)
        if not self.batched or not serves_at_least(jobs, self.min_jobs):
            return  # each job samples itself, its RNG untouched here
        p = plan(jobs)
        if p.total_rows != logits.shape[0]:
            return
        import torch

        rows = logits[:, 0, : self.vocab]
        if not p.every_row:  # through pinned memory: a pageable copy would wait for the pass
            index = torch.tensor(p.rows)
            if logits.is_cuda:
                index = index.pin_memory().to(logits.device, non_blocking=True)
            rows = rows.index_select(0, index)
        token, _ = pick_on_device(rows, p.params, p.truncates)
        n = len(p.jobs)
        if self._host is None or n > self._host.shape[0]:
            size = max(n, int(self.gen.max_batch_size))
            self._host = torch.empty((size, 1), dtype=torch.long, pin_memory=logits.is_cuda)
        host = self._host[:n]
        host.copy_(token, non_blocking=True)
        for i, job in enumerate(p.jobs):
            job.genq_next = (self.step, host[i : i + 1])  # (1, 1), as its sampler returns
        self.batched_tokens += n


class _SamplingModel(ModelProxy):
    """The generator's model, with `BatchSampler.after_decode` after each decode pass."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        decode = bool((kwargs.get("params") or {}).get("pinned_staging"))  # iterate_gen's
        if decode:
            self._sampler.before_decode()
        out = self._model.forward(*args, **kwargs)
        if decode:
            self._sampler.after_decode(out)
        return out


_GENERATOR_NEEDS = ("active_jobs", "model", "tokenizer", "max_batch_size")


def install(
    generator: Any, min_jobs: int = 1, vocab_size: int | None = None, batched: bool = True
) -> BatchSampler | None:
    """With `batched`, sample `generator`'s eligible jobs in one batched pass (in passes
    serving at least `min_jobs` of them: the engine passes GENQ_BATCHED_SAMPLING_MIN_JOBS);
    with `vocab_size` (the model's logits width, the matchers' vocabulary), mask constrained
    jobs' rows; always, apply jobs' logit biases and minimums: the generator's `genq_sampler`
    (with `batched`), `genq_masks` (with `vocab_size`) and `genq_edits`. None (and a
    warning) when this exllamav3 lacks what the hook relies on: each job keeps its own sampler,
    and the engine refuses constrained jobs."""
    missing = [a for a in _GENERATOR_NEEDS if not hasattr(generator, a)]
    if missing:
        lacks = ", ".join(missing)
        log.warning(
            "batched sampling and constraints are off: this exllamav3 generator lacks %s", lacks
        )
        return None
    masks = StepMasks(vocab_size) if vocab_size else None
    sampler = BatchSampler(generator, max(1, min_jobs), masks, batched)
    generator.model = _SamplingModel(generator.model, sampler)
    generator.genq_edits = sampler.edits
    if batched:
        generator.genq_sampler = sampler
    if masks is not None:
        generator.genq_masks = masks
    return sampler


@functools.cache
def job_class() -> type:
    """exllamav3's `Job`, taking the token the batched pass sampled for it when there is one,
    and feeding each token it takes to its constraint's matcher (`genq_matcher`, set by the
    engine). Its constructor is `Job`'s (genq names every argument it passes); `genq_params`
    is set after it."""
    from exllamav3 import Job

    class GenqJob(Job):  # type: ignore[misc]
        genq_params: RowParams | None = None
        genq_next: tuple[int, Any] | None = None
        """(decode pass, token) sampled in the batch for this job."""
        genq_matcher: Any = None
        genq_failed: str | None = None
        genq_bias: tuple[list[int], list[float]] | None = None
        genq_min_tokens = 0

        def receive_logits(self, logits: Any) -> Any:
            token = take(self)
            if token is None:
                return super().receive_logits(logits)
            return token, None, None, None

        def receive_sample(self, logits: Any, next_token: Any, *args: Any, **kwargs: Any) -> Any:
            if self.genq_matcher is not None:  # consumed after the step, with the others'
                self.generator.genq_masks.take(self, next_token)
            return super().receive_sample(logits, next_token, *args, **kwargs)

    return GenqJob
