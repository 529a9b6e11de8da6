"""Jobs past their deadline (`timeout_s`): the sweep any process may run over the deadlines
index, ending queued jobs `expired` wherever they wait. Running jobs are their worker's to
stop (it cancels them in its engine and writes the end)."""

from __future__ import annotations

import time
from typing import Any

from shared import events
from shared.events import ErrorEvent
from shared.keys import Keys
from shared.records import JobRecord
from shared.schemas import ErrorInfo
from shared.settings import JobSettings
from shared.transitions import JobState, ScriptRunner, Transitions

EXPIRED_CODE = "deadline_exceeded"
QUEUED_MESSAGE = "the job timed out before a worker started it"


async def expire_queued(
    redis: Any, scripts: ScriptRunner, keys: Keys, settings: JobSettings, limit: int
) -> list[str]:
    """End up to `limit` queued jobs past their deadline; their ids. Jobs in the index that
    are not queued (running, ended, gone) leave it."""
    index = keys.deadlines()
    now = time.time()
    due: list[str] = await redis.zrangebyscore(index, "-inf", now, start=0, num=limit)
    if not due:
        return []
    transitions = Transitions(keys)
    states = await scripts.run_all([transitions.state(j) for j in due])
    settles = [
        (job_id, _expire(transitions, job_id, st, settings, now))
        for job_id, st in zip(due, states, strict=True)
        if isinstance(st, JobState) and st.status == "queued"
    ]
    results = await scripts.run_all([call for _, call in settles])
    expired = [job_id for (job_id, _), ok in zip(settles, results, strict=True) if ok is True]
    # A queued job that changed under the sweep stays for the next one; the rest leave.
    changed = {job_id for (job_id, _), ok in zip(settles, results, strict=True) if ok is not True}
    leave = [j for j in due if j not in changed]
    if leave:
        await redis.zrem(index, *leave)
    return expired


def _expire(
    transitions: Transitions, job_id: str, st: JobState, settings: JobSettings, now: float
) -> Any:
    seq = st.last_seq + 1
    event = ErrorEvent(seq=seq, attempt=st.attempt, code=EXPIRED_CODE, message=QUEUED_MESSAGE)
    return transitions.settle(
        job_id,
        status="queued",
        attempt=st.attempt,
        last_seq=st.last_seq,
        event=(seq, events.encode(event)),
        fields=JobRecord.fields(
            status="expired",
            finished_at=now,
            error=ErrorInfo(code=EXPIRED_CODE, message=QUEUED_MESSAGE),
        ),
        maxlen=settings.event_log_maxlen,
        retention_s=settings.retention_s,
    )
