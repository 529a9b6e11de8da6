"""The worker's line per job step — started, and its end (finished, failed, expired, cancelled),
requeued, dead-lettered — and the counts behind the periodic summary (worker/summary.py).

One line per step, never per token; ids, sizes and timings only: never a prompt, its text or
the owner's key. At the default level a healthy job is one line, its end here ("job
finished": queue time, tokens, timings, how it ended); the steps before it ("job queued" at
the gateway, "job started" here) are debug lines. What is not healthy (a failed attempt, a
requeue, a dead letter, a cancel, a deadline) stays at info or above.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from worker.jobstate import Claim, Ending, RunningJob

if TYPE_CHECKING:
    from worker.state import WorkerState

log = logging.getLogger(__name__)

_END_MESSAGES = {
    "succeeded": "job finished",
    "failed": "job failed",
    "expired": "job expired",
    "cancelled": "job cancelled",
}


def started(st: WorkerState, run: RunningJob) -> None:
    st.counts.started += 1
    log.debug(
        "job started",
        extra={
            "job_id": run.id,
            "attempt": run.attempt,
            "worker_id": st.id,
            "model": run.spec.model,
            "queue_s": round(run.started_wall - run.spec.created_at, 3),
            "resumed_tokens": len(run.resumed_ids),
        },
    )


def ended(st: WorkerState, run: RunningJob) -> None:
    """The job's end is written: one line saying how it ended."""
    outcome = run.ending
    if outcome is None:
        return
    st.counts.count_end(outcome.status)
    fields = _end_fields(outcome)
    fields.update(job_id=run.id, attempt=run.attempt, worker_id=st.id, model=run.spec.model)
    level = logging.WARNING if outcome.status == "failed" else logging.INFO
    log.log(level, _END_MESSAGES.get(outcome.status, "job ended"), extra=fields)


def _end_fields(outcome: Ending) -> dict[str, object]:
    u, t = outcome.usage, outcome.timings
    fields: dict[str, object] = {
        "status": outcome.status,
        "prompt_tokens": u.prompt_tokens,
        "generation_tokens": u.completion_tokens,
        "cached_tokens": u.cached_tokens,
        "queue_s": t.queue_s,
        "ttft_s": t.ttft_s,
        "decode_s": t.generation_s,
        "tokens_per_s": _rate(u.completion_tokens, t.generation_s),
    }
    if outcome.finish_reason is not None:
        fields["finish_reason"] = outcome.finish_reason
    if outcome.detail is not None:
        fields["code" if outcome.status in ("failed", "expired") else "reason"] = outcome.detail
    return fields


def _rate(tokens: int, seconds: float | None) -> float | None:
    return round(tokens / seconds, 1) if seconds else None


def requeued(st: WorkerState, claim: Claim, attempt: int, *, counted: bool, why: str) -> None:
    """The job went back to its queue for any worker (a failed attempt when `counted`)."""
    st.counts.requeued += 1
    log.info(
        "job requeued",
        extra={
            "job_id": claim.job_id,
            "attempt": attempt,
            "worker_id": st.id,
            "counted": counted,
            "why": why,
        },
    )


def dead_lettered(st: WorkerState, claim: Claim, attempts: int, reason: str) -> None:
    st.counts.dead_lettered += 1
    log.warning(
        "job dead-lettered",
        extra={"job_id": claim.job_id, "attempts": attempts, "worker_id": st.id, "why": reason},
    )
