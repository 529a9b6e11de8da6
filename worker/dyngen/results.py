"""A dynamic generator's per-step result dicts (`ExLlamaV2DynamicGenerator.iterate()`,
exllamav3's `Generator.iterate()`) → StepOutputs: text, token ids, finish reason, usage and
logprobs. Results come as tensors on a GPU install and as lists in tests; both read the same."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from shared.schemas import FinishReason
from worker.engine import EngineJob, StepOutput

FINISH_REASONS: dict[str, FinishReason] = {
    "stop_token": "stop",
    "stop_string": "stop",
    "end_filter": "stop",
    "max_new_tokens": "length",
}
"""`eos_reason` → finish reason, the ones both libraries report (exllamav2's whole set)."""


def step_output(
    r: dict[str, Any],
    job: EngineJob,
    prompt_tokens: int,
    piece: Callable[[int], str],
    reasons: dict[str, FinishReason] = FINISH_REASONS,
) -> StepOutput | None:
    """What one "streaming" result says about `job`; None when it holds nothing to send yet.
    `piece` is the text of one token id; `reasons` maps the result's `eos_reason` (exllamav3's
    result dicts read the same, with reasons of its own)."""
    text = r.get("text", "")
    token_ids = _flat(r.get("token_ids"))
    probs, top = r.get("token_probs"), (r.get("top_k_tokens"), r.get("top_k_probs"))
    out = StepOutput(job_id=job.id)
    if r.get("eos"):
        reason = r.get("eos_reason", "max_new_tokens")
        if reason == "stop_token":
            # The stop token itself is not output, but text held back before it (a partial
            # stop string, half a UTF-8 character) is.
            text, token_ids, probs, top = _held_before_stop(r, piece)
        out.finish_reason = reasons.get(reason, "stop")
        out.prompt_tokens = prompt_tokens
        out.cached_tokens = min(int(r.get("cached_tokens", 0)), prompt_tokens)
    elif not text and not token_ids:
        return None  # held back (possible stop string): nothing to say yet
    out.text = text if job.text else ""  # else the worker makes it from the ids
    out.token_ids = token_ids
    n = job.sampling.logprobs
    if n is not None and token_ids:
        out.logprobs = logprobs(token_ids, probs, top, n, piece)
    return out


def _held_before_stop(
    r: dict[str, Any], piece: Callable[[int], str]
) -> tuple[str, list[int], Any, Any]:
    held = r.get("held") or {}
    ids = _flat(held.get("token_ids"))[:-1]
    text = held.get("text", "")
    stop_piece = piece(int(r.get("eos_triggering_token_id", -1)))
    if stop_piece and text.endswith(stop_piece):
        text = text[: -len(stop_piece)]
    probs = _rows(held.get("token_probs"))
    ks, kp = _rows(held.get("top_k_tokens")), _rows(held.get("top_k_probs"))
    return text, ids, probs[:-1] if probs else None, (ks[:-1], kp[:-1]) if ks else (None, None)


def logprobs(
    ids: list[int], probs: Any, top: Any, n: int, piece: Callable[[int], str]
) -> list[dict[str, Any]]:
    """The probabilities each library reports for its sampled tokens, as log-probabilities
    (exllamav2's are of the distribution actually sampled, after temperature and
    truncation)."""
    p = _rows(probs)
    k_ids, k_probs = _rows(top[0]), _rows(top[1])
    out = []
    for i, tid in enumerate(ids):
        entry: dict[str, Any] = {
            "token": piece(tid),
            "token_id": tid,
            "logprob": _log(p[i]) if i < len(p) else None,
        }
        alts = []
        if n and i < len(k_ids):
            for aid, ap in zip(k_ids[i][:n], k_probs[i][:n], strict=False):
                alts.append({"token": piece(int(aid)), "token_id": int(aid), "logprob": _log(ap)})
        entry["top_logprobs"] = alts
        out.append(entry)
    return out


def _tolist(x: Any) -> Any:
    return x.tolist() if hasattr(x, "tolist") else x


def _flat(x: Any) -> list[int]:
    """Token ids of a (1, n) tensor (or nested list) as a flat list."""
    if x is None:
        return []
    v = _tolist(x)
    while v and isinstance(v[0], list):
        v = v[0]
    return [int(t) for t in v]


def _rows(x: Any) -> list[Any]:
    """A (1, n[, k]) tensor's n rows as lists."""
    if x is None:
        return []
    v = _tolist(x)
    return list(v[0]) if v and isinstance(v[0], list) else list(v)


def _log(p: float) -> float:
    return math.log(p) if p > 0 else float("-inf")
