"""Sampling on the GPU for the exllamav2 engine.

exllamav2's dynamic generator copies every decode step's logits to the host — batch × vocabulary
floats, 33 MB for 64 jobs of a 128k-token model, into pageable memory — and samples each job
on the CPU, one `ExLlamaV2Sampler.sample` call per job through a thread pool. At a full batch
that is milliseconds on the critical path of every step and most of a core per worker
process, which is what several processes per GPU (and several GPUs per host) compete for.

genq samples the jobs it can on the GPU instead, in one batched pass over the logits while they
are still on the device (worker/dyngen/batch_pass.py, which exllamav3's engine runs too), and
hands each job its token:

- `install(generator)` wraps the generator's model (`_SamplingModel`): after each decode
  forward pass (`forward_chunk` without `preprocess_only`), `plan()` finds the rows of jobs
  that GPU sampling serves, in the generator's own row order, and `sample_on_device()` picks
  their tokens in one pass; one small copy brings tokens and probabilities to the host.
- Jobs are made with `job_class()`, a subclass of `ExLlamaV2DynamicJob` whose
  `receive_logits` returns that token instead of calling the CPU sampler.
- When every row was sampled, the generator gets a one-column view of the logits and a
  one-column host buffer, so nothing vocabulary-sized crosses to the host, and its sampling
  pool is skipped for the step. Otherwise it gets the real logits and samples the other jobs
  on the CPU as before.

What stays on exllamav2's CPU sampler (per job, `job_params()` is None): repetition,
presence and frequency penalties, top logprobs (`return_top_tokens`), filters, CFG, token
healing, banned strings, and any sampler setting besides temperature, top_k, top_p and min_p
(the engine's `SamplingSupport.per_job` names the request's settings among them). A job's
logit bias and minimum of new tokens are not handed to exllamav2 (`token_bias`,
`min_new_tokens` would send it there too): the same hook applies them to the logits on the
device first (worker/dyngen/edits.py).

Semantics, both paths: one uniform draw from the job's own seeded RNG per token; temperature
below 0.01 or top_k = 1 is greedy (argmax); otherwise softmax(logits / temperature), then
top_k, then top_p (the fewest most likely tokens whose mass, of what top_k kept, reaches
top_p), then min_p (tokens at least min_p × the most likely one), then the token at which
the cumulative mass passes the draw × the mass kept. The probability reported for a token
(logprobs) is its share of the kept mass, as exllamav2 reports it. This top_p keeps the
token that crosses the threshold (the usual definition); exllamav2's CPU sampler stops
just before it.

Constrained jobs (worker/dyngen/masks.py): the same hook masks their rows of the logits on the
device first, so both paths above sample only allowed tokens (the CPU sampler reads the masked
logits the generator copies to the host); the hook is installed with GPU sampling off too
(`install(..., sample=False)`), masking alone. The job feeds each token it takes to its matcher
in `receive_sample`.

This module imports torch and exllamav2 only inside functions, so it loads on a CPU install;
`job_params` and `plan` are plain Python and tested there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from worker.dyngen.batch_pass import ModelProxy, Plan, RowParams, pick_on_device, plan_rows
from worker.dyngen.edits import StepEdits
from worker.dyngen.masks import StepMasks

log = logging.getLogger(__name__)

UNUSED = {
    "smoothing_factor": 0.0,
    "min_temp": 0.0,
    "max_temp": 0.0,
    "top_a": 0.0,
    "tfs": 0.0,
    "typical": 0.0,
    "skew": 0.0,
    "temperature_last": False,
    "mirostat": False,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "cfg_scale": None,
}
"""exllamav2 sampler settings genq does not offer, at their neutral values; the engine sets
them explicitly (exllamav2's own defaults are not all neutral)."""
NEUTRAL = {
    "token_repetition_penalty": 1.0,
    "token_frequency_penalty": 0.0,
    "token_presence_penalty": 0.0,
    **UNUSED,
}
"""Sampler settings that must hold these values for a job to be sampled on the GPU."""
NO_POOL = 1 << 30
"""`min_sampling_threads` for a step whose every row was sampled here: skip the pool."""


def job_params(job: Any) -> RowParams | None:
    """How GPU sampling serves this job (an `ExLlamaV2DynamicJob`), or None: the CPU sampler."""
    if (
        len(job.sequences) != 1
        or job.filters
        or job.prefix_token is not None
        or job.return_top_tokens
        or job.return_logits
        or job.banned_strings
        or job.min_new_tokens > 0
    ):
        return None
    s = job.gen_settings
    if getattr(s, "token_bias", None) is not None:  # a tensor: not compared as the rest
        return None
    if any(getattr(s, name, value) != value for name, value in NEUTRAL.items()):
        return None
    if getattr(s, "post_sampling_hooks", None):
        return None
    return RowParams(float(s.temperature), int(s.top_k), float(s.top_p), float(s.min_p))


def served_this_step(job: Any) -> bool:
    """exllamav2: a job with `genq_params` takes its token from the pass unless it is inside a
    banned-string checkpoint or healing a token."""
    return job.checkpoint is None and job.new_tokens >= 0


def plan(active_jobs: Iterable[Any], served: Callable[[Any], bool] = served_this_step) -> Plan:
    """The rows of this decode step and which of them are sampled here
    (`batch_pass.plan_rows`, with exllamav2's rule of which jobs the pass serves)."""
    return plan_rows(active_jobs, served)


def sample_on_device(logits: Any, params: Sequence[tuple[float, ...]], truncates: bool) -> Any:
    """Tokens and their probabilities for `logits` (rows × vocabulary, on the GPU), one row per
    entry of `params`; returned on the host as an (n, 2) float64 tensor: token id, probability.
    Queued behind the forward pass on the same stream; the one copy back waits for both."""
    import torch

    token, prob = pick_on_device(logits, params, truncates)
    return torch.cat([token.double(), prob.double()], dim=1).cpu()


class GpuSampler:
    """Installed on one generator by `install`; counts what it sampled. `sample` False: the
    hook masks constrained rows (`masks`) and leaves every job to the CPU sampler."""

    def __init__(
        self, generator: Any, masks: StepMasks, sample: bool = True, edits: StepEdits | None = None
    ) -> None:
        import torch

        self.gen = generator
        self.masks = masks
        self.edits = edits or StepEdits()
        self.sample = sample
        self.vocab = int(generator.tokenizer.get_vocab_size())
        self._full = generator.logits_pinned
        self._narrow = torch.empty((*self._full.shape[:2], 1), dtype=self._full.dtype)
        self._min_threads = generator.min_sampling_threads
        self.step = 0
        """Decode passes seen; a job takes a token only from the pass it was sampled in."""
        self.gpu_tokens = 0
        self.cpu_steps = 0
        """Decode steps in which some job still needed the CPU sampler."""

    def profile(self) -> dict[str, float | int]:
        return {"gpu_tokens": self.gpu_tokens, "cpu_steps": self.cpu_steps, "passes": self.step}

    def before_forward(self) -> None:
        self.masks.start(self.gen.active_jobs)

    def after_forward(self, out: dict[str, Any]) -> dict[str, Any]:
        logits = out.get("logits")
        gen = self.gen
        gen.logits_pinned, gen.min_sampling_threads = self._full, self._min_threads
        self.step += 1
        if logits is None or logits.dim() != 3 or logits.shape[1] != 1:
            return out
        self.edits.apply(logits, gen.active_jobs)
        self.masks.apply(logits, gen.active_jobs)
        if not self.sample:
            return out
        p = plan(gen.active_jobs)
        if not p.rows or p.total_rows != logits.shape[0]:
            if p.total_rows:
                self.cpu_steps += 1
            return out
        import torch

        rows = logits[:, 0, : self.vocab]
        if not p.every_row:
            rows = rows.index_select(0, torch.tensor(p.rows, device=logits.device))
        picked = sample_on_device(rows, p.params, p.truncates)
        tokens = picked[:, :1].long().split(1)  # (1, 1) each, as the CPU sampler returns them
        probs = picked[:, 1:].float().split(1)
        for job, token, prob in zip(p.jobs, tokens, probs, strict=True):
            job.genq_next = (self.step, token, prob)
        self.gpu_tokens += len(p.jobs)
        if not p.every_row:
            self.cpu_steps += 1
            return out
        gen.logits_pinned, gen.min_sampling_threads = self._narrow, NO_POOL
        return {**out, "logits": logits[:, :, :1]}


class _SamplingModel(ModelProxy):
    """The generator's model, with `GpuSampler.after_forward` after each decode pass."""

    def forward_chunk(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("preprocess_only"):  # the step's masks, while the pass runs
            self._sampler.before_forward()
        out = self._model.forward_chunk(*args, **kwargs)
        if kwargs.get("preprocess_only") or not isinstance(out, dict):
            return out
        return self._sampler.after_forward(out)


_GENERATOR_NEEDS = ("logits_pinned", "min_sampling_threads", "active_jobs", "model", "tokenizer")


def install(generator: Any, vocab_size: int, sample: bool = True) -> GpuSampler | None:
    """Apply jobs' logit biases and minimums and mask constrained jobs' rows (`vocab_size`:
    the model's logits width, the matchers' vocabulary) and, with `sample`, sample
    `generator`'s GPU-eligible jobs on the GPU; the generator's `genq_edits`, `genq_masks` and
    (with `sample`) `genq_sampler`. None (and a warning) when this
    exllamav2 lacks what the hook relies on: the CPU sampler carries on alone, and the engine
    refuses constrained jobs."""
    missing = [a for a in _GENERATOR_NEEDS if not hasattr(generator, a)]
    if missing:
        log.warning(
            "GPU sampling and constraints are off: this exllamav2 generator lacks %s",
            ", ".join(missing),
        )
        return None
    masks = StepMasks(vocab_size)
    sampler = GpuSampler(generator, masks, sample)
    generator.model = _SamplingModel(generator.model, sampler)
    generator.genq_masks = masks
    generator.genq_edits = sampler.edits
    if sample:
        generator.genq_sampler = sampler
    return sampler


@functools.cache
def job_class() -> type:
    """`ExLlamaV2DynamicJob` that takes a token sampled on the GPU when it has one, and feeds
    each token it takes to its constraint's matcher (`genq_matcher`, set by the engine)."""
    from exllamav2.ext import none_tensor
    from exllamav2.generator import ExLlamaV2DynamicJob

    class GenqJob(ExLlamaV2DynamicJob):  # type: ignore[misc]
        genq_matcher: Any = None
        genq_failed: str | None = None
        genq_bias: tuple[list[int], list[float]] | None = None
        genq_min_tokens = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.genq_params = job_params(self)
            self.genq_next: tuple[int, Any, Any] | None = None
            """(decode pass, token, probability) sampled on the GPU for this job."""

        def receive_logits(self, logits: Any) -> Any:
            picked, self.genq_next = self.genq_next, None
            sampler = getattr(self.generator, "genq_sampler", None)
            if picked is None or sampler is None or picked[0] != sampler.step:
                return super().receive_logits(logits)
            return picked[1], none_tensor, none_tensor, picked[2], False

        def receive_sample(self, logits: Any, next_token: Any, *args: Any, **kwargs: Any) -> Any:
            if self.genq_matcher is not None:  # consumed after the step, with the others'
                self.generator.genq_masks.take(self, next_token)
            return super().receive_sample(logits, next_token, *args, **kwargs)

    return GenqJob
