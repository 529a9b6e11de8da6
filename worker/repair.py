"""A Redis that restarted without its last writes (AOF `everysec` and a host crash) may have
lost the end of jobs this worker finished: the record says `running` (at this worker and
attempt) and the log stops short. The worker writes what it remembers again (the events of
its last `log_repair_window_s` and the job's end), so the log holds exactly what readers saw,
and the job does not run again. What this worker no longer remembers, or a job another worker
took meanwhile, is left to the queue (a new attempt continues from what the log kept)."""

from __future__ import annotations

import logging

from shared.transitions import JobState, Written
from worker.entries import ack
from worker.jobstate import FinishedJob
from worker.state import WorkerState

log = logging.getLogger(__name__)


async def repair_finished(st: WorkerState, job_ids: list[str] | None = None) -> list[str]:
    """Write again the lost ends of recently finished jobs (these, or all remembered); the ids
    of the jobs repaired."""
    runs = [
        run
        for job_id, (_, run) in list(st.finished.items())
        if job_ids is None or job_id in job_ids
    ]
    if not runs:
        return []
    states = await st.scripts.run_all([st.transitions.state(r.id) for r in runs])
    lost = [
        (run, s)
        for run, s in zip(runs, states, strict=True)
        if isinstance(s, JobState) and _lost_end(st, run, s)
    ]
    repaired: list[FinishedJob] = []
    for run, s in lost:
        missing = run.written_after(s.last_seq)
        if missing is None:
            log.warning(
                "a finished job's lost end is older than the repair window",
                extra={
                    "job_id": run.id,
                    "log_ends_at": s.last_seq,
                },
            )
            continue
        call = st.transitions.emit(
            run.id,
            worker=st.id,
            attempt=run.attempt,
            events=missing,
            maxlen=st.settings.event_log_maxlen,
            fields=run.end,
            retention_s=st.settings.retention_s,
        )
        reply = await st.scripts.run(call)
        if isinstance(reply, Written):
            log.warning(
                "rewrote the lost end of a finished job",
                extra={
                    "job_id": run.id,
                    "from": s.last_seq + 1,
                },
            )
            repaired.append(run)
    if repaired:
        await ack(st, [r.claim for r in repaired])  # the ack was lost with the rest
    return [r.id for r in repaired]


def _lost_end(st: WorkerState, run: FinishedJob, s: JobState) -> bool:
    """The record went back to this worker's running attempt, short of what it wrote."""
    return (
        s.status == "running"
        and s.worker == st.id
        and s.attempt == run.attempt
        and s.last_seq < run.seq
    )
