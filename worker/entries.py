"""Moving queue entries: ack, requeue, hand back, dead-letter. Every phase that lets go of a
claim goes through here, so an entry always leaves the pending list the same way."""

from __future__ import annotations

import contextlib
import logging
import time

from redis.exceptions import RedisError, ResponseError

from shared.keys import CONSUMER_GROUP
from shared.records import DeadLetter, QueueEntry
from worker import joblog
from worker.jobstate import Claim, RunningJob
from worker.state import WorkerState

log = logging.getLogger(__name__)
_DEAD_LETTERS_KEPT = 100_000


async def ensure_groups(st: WorkerState) -> None:
    for key in st.all_streams():
        with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
            await st.redis.xgroup_create(key, CONSUMER_GROUP, id="0", mkstream=True)


async def requeue(st: WorkerState, claim: Claim) -> None:
    """A fresh queue entry for the job, and ours acknowledged, in one transaction. One taken
    from a worker lane goes to the shared queue: any worker may take it now."""
    pipe = st.redis.pipeline(transaction=True)
    entry = QueueEntry(job=claim.job_id, tokens=claim.need_tokens, owner=claim.owner)
    pipe.xadd(st.shared_queue(claim.queue), entry.to_hash())
    pipe.xack(claim.queue, CONSUMER_GROUP, claim.entry_id)
    pipe.xdel(claim.queue, claim.entry_id)
    await pipe.execute()


async def requeue_waiting(st: WorkerState) -> None:
    waiting, st.waiting = st.waiting, []
    for claim in waiting:
        with contextlib.suppress(RedisError, OSError):
            await requeue(st, claim)


async def hand_back(
    st: WorkerState,
    run: RunningJob,
    *,
    counted: bool,
    interrupted: bool = False,
    error: str = "",
    why: str = "",
) -> None:
    """Give a started job back to the queue for any worker, now (not after the lease).
    Fenced: a job that already moved to another worker is left alone. `interrupted`: a stop
    of this worker ends the attempt (counted against GENQ_MAX_INTERRUPTIONS); `error`: the
    failed attempt's (recorded); `why`: what the log line says otherwise."""
    call = st.transitions.hand_back(
        run.id,
        worker=st.id,
        attempt=run.attempt,
        counted=counted,
        interrupted=interrupted,
        error=error,
    )
    if await st.scripts.run(call):
        await requeue(st, run.claim)
        joblog.requeued(st, run.claim, run.attempt, counted=counted, why=error or why)
    else:
        log.warning("hand-back fenced: the job moved on", extra={"job_id": run.id})


async def drop_malformed(st: WorkerState, queue: str, entry_id: str, reason: str) -> None:
    """An entry that names no job genq can run: to the dead letters with the reason, and out
    of the queue, so it cannot stall the claim or reclaim loops."""
    letter = DeadLetter(queue=queue, entry=entry_id, reason=reason, at=time.time())
    pipe = st.redis.pipeline(transaction=True)
    pipe.xadd(
        st.keys.dead_letters(),
        letter.to_hash(),
        maxlen=_DEAD_LETTERS_KEPT,
        approximate=True,
    )
    pipe.xack(queue, CONSUMER_GROUP, entry_id)
    pipe.xdel(queue, entry_id)
    await pipe.execute()
    log.error(
        "malformed queue entry dead-lettered",
        extra={"queue": queue, "entry": entry_id, "reason": reason},
    )


async def ack(st: WorkerState, claims: list[Claim]) -> None:
    pipe = st.redis.pipeline(transaction=False)
    for c in claims:
        pipe.xack(c.queue, CONSUMER_GROUP, c.entry_id)
        pipe.xdel(c.queue, c.entry_id)
    await pipe.execute()


async def dead_letter(st: WorkerState, claim: Claim, attempts: int, reason: str) -> None:
    entry = DeadLetter(
        job=claim.job_id,
        queue=claim.queue,
        entry=claim.entry_id,
        attempts=attempts,
        reason=reason,
        at=time.time(),
    )
    await st.redis.xadd(
        st.keys.dead_letters(),
        entry.to_hash(),
        maxlen=_DEAD_LETTERS_KEPT,
        approximate=True,
    )
    st.metrics.dead_lettered.inc()
    joblog.dead_lettered(st, claim, attempts, reason)
