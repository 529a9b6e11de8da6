"""Sampling for exllamav3 jobs: always an explicit `ComboSampler`, every argument named.

exllamav3's `Job` and `Generator` take `**kwargs` and drop what they do not know: a misspelt
or renamed argument (exllamav2's `gen_settings=`) leaves a job with exllamav3's
`DefaultSampler` (min_p 0.08, temperature 0.8) and no error. So `combo_args` sets every
`ComboSampler` argument, to the request's value or to its neutral one, and `checked_kwargs`
refuses any keyword its callee does not name.

What exllamav3 does with them (its `ComboSampler`, on the GPU, one fused kernel per job):
the logit bias first (genq applies it itself on the logits where its hook is installed:
worker/dyngen/edits.py), then penalties (repetition, then presence and frequency, over the whole
context, prompt included), then greedy (argmax) when temperature is 0 or top_k is 1, else
temperature, min_p, top_k, top_p and a draw from the job's own seeded RNG. Top logprobs are of
the model's own distribution (softmax of the logits, before temperature and truncation).

Plain Python: imports nothing of exllamav3, so it is tested on a CPU install.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from shared.schemas import Sampling
from worker.engine import SamplingSupport

WHOLE_CONTEXT = 10**8
"""`rep_sustain_range` covering any context: ComboSampler's own default, set explicitly."""


SAMPLING_SUPPORT = SamplingSupport(
    sampler=frozenset(
        {
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        }
    ),
    elsewhere={
        "seed": "`job_args`' seed: `EngineJob.seed` (the spec's, else one drawn from the job id)",
        "stop": "the engine's `add`: stop conditions (the worker matches them without `job.text`)",
        "stop_token_ids": "the engine's `add`: stop conditions",
        "logprobs": "`job_args`: return_top_tokens and return_probs",
        "logit_bias": "genq's hook (worker/dyngen/edits.py): added to the job's row of the "
        "logits on the device (without the hook: `combo_args`' logit_bias)",
        "min_tokens": "genq's hook (worker/dyngen/edits.py): the stop tokens masked in the job's "
        "row until then (without the hook: `job_args`' min_new_tokens); less what an earlier "
        "attempt sent",
        "banned_strings": "`job_args`: banned_strings",
    },
    per_job={
        "repetition_penalty": "exllamav3's ComboSampler penalises over the job's context, "
        "which only the library holds per job",
        "presence_penalty": "as repetition_penalty",
        "frequency_penalty": "as repetition_penalty",
        "logprobs": "exllamav3 reports probabilities of the model's own distribution, a "
        "softmax (and, for top logprobs, a sort) of the job's row: per job",
        "banned_strings": "exllamav3 rewinds the job to a checkpoint and samples again with the "
        "tokens it tried blocked: per job by nature",
    },
)
"""Where the exllamav3 engine honours each sampler setting: `combo_args` maps the rest."""


def combo_args(s: Sampling) -> dict[str, Any]:
    """Every `ComboSampler` argument for `s`; the ones genq does not offer at their neutral
    values (DRY off, no adaptive-P, temperature first)."""
    greedy = s.temperature == 0.0
    return {
        "rep_p": s.repetition_penalty,
        "freq_p": s.frequency_penalty,
        "pres_p": s.presence_penalty,
        "rep_sustain_range": WHOLE_CONTEXT,
        "rep_decay_range": 0,
        "dry_multiplier": 0.0,
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_range": 0,
        "dry_sequence_breakers": None,
        "temperature": 0.0 if greedy else s.temperature,
        "min_p": 0.0 if greedy else s.min_p,
        "top_k": 0 if greedy else s.top_k,
        "top_p": 1.0 if greedy else s.top_p,
        "temp_last": False,
        "adaptive_target": 1.0,
        "adaptive_decay": 0.9,
        "logit_bias": {int(k): v for k, v in s.logit_bias.items()} or None,
    }


def make_sampler(sampler_cls: Callable[..., Any], s: Sampling) -> Any:
    return sampler_cls(**checked_kwargs(sampler_cls, combo_args(s)))


def checked_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs`, if `fn` names every one of them; else TypeError (instead of `fn` taking
    them into its `**kwargs` and ignoring them)."""
    unknown = sorted(set(kwargs) - named_parameters(fn))
    if unknown:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"{name} takes no argument {', '.join(unknown)} (this exllamav3 differs)")
    return kwargs


@functools.cache
def named_parameters(fn: Callable[..., Any]) -> frozenset[str]:
    params = inspect.signature(fn).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
