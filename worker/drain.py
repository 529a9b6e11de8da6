"""A worker's drain, at its stop (SIGTERM, Ctrl-C): it claims nothing more, hands back the
claims it has not started, lets the running jobs someone waits on finish within the grace
(`GENQ_SHUTDOWN_GRACE_S`), and hands the rest back to the queue.

Someone waits on a job while a gateway holds the job's pub/sub channel: an open stream (native
or OpenAI), or an OpenAI request waiting for its answer. A job nobody waits on (a batch line, a
background response, a job submitted without a stream, or one carried over from an earlier
stop whose client is long gone) is handed back at once: another worker continues it from its
last token now, or the next start does. So such a job never holds a stop for its grace.

Every running job handed back at a drain counts one interruption, so that a job longer than
any run of the server cannot carry over forever: START fails one interrupted more than
`GENQ_MAX_INTERRUPTIONS` times. A hand-back costs no attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from worker.entries import hand_back, requeue_waiting
from worker.state import WorkerState

log = logging.getLogger(__name__)


async def drain(st: WorkerState, grace_s: float) -> None:
    """Hand back claims not started yet and the running jobs nobody waits on at once; let the
    others finish for up to `grace_s` (or until `st.hurry`); hand the rest back. A failed
    hand-back leaves the entry to be reclaimed."""
    deadline = time.monotonic() + grace_s
    await requeue_waiting(st)
    if st.running and not st.hurry.is_set():
        unwatched = await _unwatched(st)
        log.info(
            "draining",
            extra={
                "grace_s": grace_s,
                "waiting_for_jobs": len(st.running) - len(unwatched),
                "handing_back_unwatched": len(unwatched),
            },
        )
        await _interrupt(st, unwatched, "nobody waits for it")
    while st.running and time.monotonic() < deadline and not st.hurry.is_set():
        st.room.clear()
        room = asyncio.ensure_future(st.room.wait())
        hurry = asyncio.ensure_future(st.hurry.wait())
        await asyncio.wait(
            {room, hurry},
            timeout=deadline - time.monotonic(),
            return_when=asyncio.FIRST_COMPLETED,
        )
        room.cancel()
        hurry.cancel()
    await requeue_waiting(st)  # what a reclaim in flight at the stop brought in
    await _interrupt(st, list(st.running), "the worker is draining")


async def _unwatched(st: WorkerState) -> list[str]:
    """The running jobs whose channel no gateway holds (one PUBSUB NUMSUB for all); none when
    Redis cannot tell: then every job keeps its grace."""
    job_ids = list(st.running)
    try:
        counts = await st.redis.pubsub_numsub(*(st.keys.channel(j) for j in job_ids))
    except (RedisError, OSError):
        return []
    return [j for j, (_, n) in zip(job_ids, counts, strict=True) if int(n) == 0]


async def _interrupt(st: WorkerState, job_ids: list[str], why: str) -> None:
    for job_id in job_ids:
        run = st.drop(job_id)
        if run is None:  # the flush loop ended it while an earlier one was handed back
            continue
        with contextlib.suppress(RedisError, OSError):
            await hand_back(st, run, counted=False, interrupted=True, why=why)
