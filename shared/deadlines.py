"""Jobs past their deadline (`timeout_s`) end `expired`, whether or not a worker is up.

Any process may sweep the deadlines index: gateways (one at a time, under a lock) and workers
(each in its heartbeat). A sweep ends queued jobs, and running jobs whose worker is gone (its
heartbeat lapsed), with a SETTLE compare-and-set; a running job with a live worker is its
worker's to stop (it cancels the job in its engine and writes the end). A job that ended
leaves the index with its end (EMIT, SETTLE).
"""

from __future__ import annotations

import time
from typing import Any

from shared import events
from shared.events import ErrorEvent
from shared.keys import Keys
from shared.records import JobRecord
from shared.schemas import ErrorInfo
from shared.settings import JobSettings
from shared.transitions import Call, JobState, ScriptRunner, Transitions

EXPIRED_CODE = "deadline_exceeded"
QUEUED_MESSAGE = "the job timed out before a worker started it"
RUNNING_MESSAGE = "the job's timeout passed while it ran"
ENDED_STATUSES = frozenset({"succeeded", "failed", "cancelled", "expired", "missing"})


async def expire_due(
    redis: Any,
    scripts: ScriptRunner,
    keys: Keys,
    settings: JobSettings,
    limit: int,
    job_ids: list[str] | None = None,
) -> list[str]:
    """End up to `limit` jobs past their deadline (or these `job_ids`) that nobody will end
    otherwise; their ids. Ended jobs leave the index."""
    now = time.time()
    if job_ids is None:  # every queue shard's index (one on one Redis)
        job_ids = []
        for shard in range(keys.shards):
            index = keys.deadlines(shard)
            job_ids += await redis.zrangebyscore(index, "-inf", now, start=0, num=limit)
    if not job_ids:
        return []
    transitions = Transitions(keys, settings.recent_jobs, settings.event_compact_grace_s)
    states = await scripts.run_all([transitions.state(j) for j in job_ids])
    running = [
        (j, st)
        for j, st in zip(job_ids, states, strict=True)
        if isinstance(st, JobState) and st.status == "running" and st.worker
    ]
    pipe = redis.pipeline(transaction=False)
    for _, st in running:
        pipe.exists(keys.worker(st.worker or ""))
    alive = {j for (j, _), n in zip(running, await pipe.execute(), strict=True) if n}
    settles: list[tuple[str, Call[bool]]] = [
        (j, _expire(transitions, j, st, settings, now))
        for j, st in zip(job_ids, states, strict=True)
        if isinstance(st, JobState)
        and (st.status == "queued" or (st.status == "running" and j not in alive))
    ]
    results = await scripts.run_all([call for _, call in settles])
    expired = [j for (j, _), ok in zip(settles, results, strict=True) if ok is True]
    ended = [
        j
        for j, st in zip(job_ids, states, strict=True)
        if isinstance(st, JobState) and st.status in ENDED_STATUSES
    ]
    for shard in {keys.shard_of(j) for j in ended}:
        # ended before their end took them out of the index (older records; on a cluster, an
        # end whose index step did not run)
        await redis.zrem(keys.deadlines(shard), *(j for j in ended if keys.shard_of(j) == shard))
    return expired


def _expire(
    transitions: Transitions, job_id: str, st: JobState, settings: JobSettings, now: float
) -> Call[bool]:
    seq = st.last_seq + 1
    message = QUEUED_MESSAGE if st.status == "queued" else RUNNING_MESSAGE
    event = ErrorEvent(seq=seq, attempt=st.attempt, code=EXPIRED_CODE, message=message)
    return transitions.settle(
        job_id,
        status=st.status,
        attempt=st.attempt,
        last_seq=st.last_seq,
        event=(seq, events.encode(event)),
        fields=JobRecord.fields(
            status="expired",
            finished_at=now,
            error=ErrorInfo(code=EXPIRED_CODE, message=message),
        ),
        maxlen=settings.event_log_maxlen,
        retention_s=settings.retention_s,
    )
