"""exllamav3's result dicts (`Generator.iterate()`) → StepOutputs.

Every result names its job by `serial` (what `enqueue` returned) and carries the `Job`; only
some carry the `identifier` (an `error` result does not), so the engine keys its jobs by
serial. Stages:

- `started`, `prefill`: nothing to send.
- `streaming`: text and token ids (exllamav2's fields and shapes, read by
  worker/dyngen/results.py: held-back text before a stop token comes in `held`), `eos` with
  an `eos_reason` at the end. A `requeue` flag means the generator moved the job back to its
  own queue to continue (a per-job token budget); genq sets no budget, and the job goes on
  under the same serial either way: ignored.
- `error`: exllamav3 contained a failure of that job alone (its pages are released); the job
  fails, the batch goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from shared.schemas import FinishReason
from worker.dyngen import results
from worker.engine import EngineJob, StepOutput

log = logging.getLogger(__name__)

FINISH_REASONS: dict[str, FinishReason] = {**results.FINISH_REASONS, "loop_detected": "stop"}
RECORDED_REASONS = frozenset({"loop_detected"})
"""Ends that read `stop` to the client but are worth a line in the worker's log."""


def streaming_output(
    r: dict[str, Any], job: EngineJob, prompt_tokens: int, piece: Callable[[int], str]
) -> StepOutput | None:
    if r.get("eos"):
        reason = r.get("eos_reason")
        if reason in RECORDED_REASONS:
            log.info("exllamav3 ended a job early", extra={"job_id": job.id, "reason": reason})
        elif reason not in FINISH_REASONS:
            log.warning("unknown exllamav3 end reason", extra={"job_id": job.id, "reason": reason})
    return results.step_output(r, job, prompt_tokens, piece, FINISH_REASONS)


def error_output(r: dict[str, Any], job: EngineJob) -> StepOutput:
    error = r.get("error")
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    log.warning("exllamav3 failed a job", extra={"job_id": job.id, "error": text})
    return StepOutput(job.id, error=f"exllamav3 failed the job: {text}")
