"""A worker's drain, at its stop (SIGTERM, Ctrl-C): it claims nothing more, hands back the
claims it has not started, hands back at once the running jobs nobody waits on any more, lets
the others finish within the grace (`GENQ_SHUTDOWN_GRACE_S`), and hands the rest back.

Nobody waits on a job any more when it was submitted by a client that follows it as it runs
(a stream, native or OpenAI, or an OpenAI request waiting for its answer: `JobSpec.followed`)
and no gateway holds its pub/sub channel now: every such client is gone (one whose going
cancels the job has cancelled it already). A job carried over from an earlier stop, whose
stream that stop ended, is one: handed back at once, it never holds the next stop for its
grace. Batch lines, background responses and jobs submitted without a stream are wanted
whether or not anyone watches them: they get the grace, as do jobs a client still follows.

Every running job handed back at a drain counts one interruption, so that a job longer than
any run of the server cannot carry over forever: START fails one interrupted more than
`GENQ_MAX_INTERRUPTIONS` times. A hand-back costs no attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from worker.entries import hand_back, requeue_waiting
from worker.state import WorkerState

log = logging.getLogger(__name__)


async def drain(st: WorkerState, grace_s: float, tell: Callable[[str], None] | None = None) -> None:
    """Hand back at once the claims not started yet and the running jobs nobody waits on any
    more; let the others finish for up to `grace_s` (or until `st.hurry`); hand the rest back.
    A failed hand-back leaves the entry to be reclaimed. `tell`: where the plan is said in
    words too (`genq serve`'s terminal)."""
    deadline = time.monotonic() + grace_s
    await requeue_waiting(st)
    if st.running and not st.hurry.is_set():
        abandoned = await _abandoned(st)
        waiting = len(st.running) - len(abandoned)
        log.info(
            "draining",
            extra={
                "grace_s": grace_s,
                "waiting_for_jobs": waiting,
                "handing_back_abandoned": len(abandoned),
            },
        )
        if tell is not None:
            tell(_in_words(waiting, len(abandoned), grace_s))
        await _interrupt(st, abandoned, "nobody waits on it any more")
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


def _in_words(waiting: int, abandoned: int, grace_s: float) -> str:
    def jobs(n: int) -> str:
        return f"{n} running job" if n == 1 else f"{n} running jobs"

    gone = "whose streams are gone went back to the queue"
    if not waiting:
        return f"stopping: {jobs(abandoned)} {gone}"
    words = f"stopping: waiting up to {grace_s:g} s for {jobs(waiting)} to finish"
    return f"{words} ({abandoned} more {gone})" if abandoned else words


async def _abandoned(st: WorkerState) -> list[str]:
    """The running jobs submitted to be followed whose channel no gateway holds now (one
    PUBSUB NUMSUB for all); none when Redis cannot tell: then every job keeps its grace."""
    followed = [job_id for job_id, run in st.running.items() if run.spec.followed]
    if not followed:
        return []
    try:
        counts = await st.redis.pubsub_numsub(*(st.keys.channel(j) for j in followed))
    except (RedisError, OSError):
        return []
    return [j for j, (_, n) in zip(followed, counts, strict=True) if int(n) == 0]


async def _interrupt(st: WorkerState, job_ids: list[str], why: str) -> None:
    for job_id in job_ids:
        run = st.drop(job_id)
        if run is None:  # the flush loop ended it while an earlier one was handed back
            continue
        with contextlib.suppress(RedisError, OSError):
            await hand_back(st, run, counted=False, interrupted=True, why=why)
