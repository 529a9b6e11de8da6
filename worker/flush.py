"""The flush phase: drain the engine's outputs, then one pipeline per drain carries every
dirty job's events (EMIT/FINISH scripts, fenced on worker + attempt); ack what ended.

This is the hot path: per drain, one Redis round trip and no per-token allocation here
(tokens fold into one event per job in `RunningJob`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from shared.constraints import SchemaCheck
from shared.redis_health import failure_level
from shared.redisconn import is_transient
from shared.schemas import FinishReason
from shared.transitions import Call, EmitReply, EncodedEvent, Fenced, LostTail
from worker import joblog
from worker.engine import StepOutput, Stop
from worker.entries import hand_back
from worker.jobstate import Claim, RunningJob
from worker.news import NewsDesk
from worker.state import WorkerState

log = logging.getLogger(__name__)
_MAX_ENGINE_FAILURES = 5
_FLUSH_RETRY_S = 0.2

Written = list[tuple[RunningJob, list[EncodedEvent]]]
"""(job, the events this flush sends for it), in pipeline order."""


class Flusher:
    def __init__(self, st: WorkerState, news: NewsDesk) -> None:
        self.st = st
        self.news = news
        self._checks: set[asyncio.Task[None]] = set()
        """Output checks under way (`_finish`): kept, so that none is collected mid-way."""
        self._ends: list[tuple[RunningJob, FinishReason, SchemaCheck | None]] = []
        """Checked outputs whose job's end is still to be made (`_checked_ends`)."""

    async def loop(self) -> None:
        """Flush every `flush_interval_ms`; a job's first tokens and its end go out at once.
        Batch-priority jobs flush every `batch_flush_interval_ms` instead, their first tokens
        and ends included (nobody waits on each token of theirs, and each flush of a job is
        a script call), and a running one only once its oldest tokens not written yet have
        waited that long: its `started` and first tokens ride with its end if it ends within
        the interval (a job of a few tokens is one write), a long one writes about once an
        interval.

        Between flushes the engine keeps stepping and each job's tokens fold into one event,
        so the cost per token falls as load rises instead of swamping Redis and gateways.
        """
        st = self.st
        assert st.runner is not None
        interval = st.settings.flush_interval_ms / 1000
        batch_interval = max(interval, st.settings.batch_flush_interval_ms / 1000)
        last_full = last_batch = 0.0
        loop = asyncio.get_running_loop()
        armed = False

        def due_now() -> None:
            nonlocal armed
            armed = False
            st.flush_wanted.set()

        while not st.closing:
            await st.flush_wanted.wait()
            st.flush_wanted.clear()
            self._collect(st.runner.drain())
            if not st.dirty:
                continue
            now = time.monotonic()
            if now - last_full >= interval:
                last_full = now
                due = set(st.dirty)
                if now - last_batch >= batch_interval:
                    last_batch = now
                    due -= self._batch_jobs(due, younger_than=now - batch_interval) - st.urgent
                else:
                    due -= self._batch_jobs(due) - st.urgent
                if due:
                    await self._timed_flush(due)
            else:
                urgent = st.urgent & st.dirty
                if urgent:
                    await self._timed_flush(urgent)
            if st.dirty and not armed:
                armed = True
                loop.call_later(max(0.0, last_full + interval - time.monotonic()), due_now)

    def _batch_jobs(self, job_ids: set[str], younger_than: float | None = None) -> set[str]:
        """The batch jobs among these; with `younger_than` (monotonic), only those still
        running whose oldest unwritten tokens came after it, or that have none yet (their
        `started` rides with the first tokens)."""
        running = self.st.running
        jobs = {j for j in job_ids if (r := running.get(j)) and r.spec.priority == "batch"}
        if younger_than is None:
            return jobs
        return {
            j
            for j in jobs
            if (r := running[j]).end is None
            and r.retry_error is None
            and (r.unwritten_since is None or r.unwritten_since > younger_than)
        }

    def _collect(self, outputs: list[StepOutput]) -> None:
        st = self.st
        self._checked_ends()
        freed = False
        ahead = st.ahead_tokens()
        for out in outputs:
            run = st.running.get(out.job_id)
            if run is None or run.attempt != out.attempt:
                continue  # an attempt this worker no longer runs
            if run.end is not None or run.retry_error is not None or run.checking:
                continue
            st.metrics.output(run, out)
            batch = run.spec.priority == "batch"
            if out.token_ids or out.text:
                if run.first_token_wall is None:
                    st.pace.first_token(run.id)
                    if not batch:
                        st.urgent.add(run.id)
                left = run.tokens_left()
                run.add_tokens(out.text, out.token_ids, out.logprobs)
                # near its end now: a job may be started ahead for its slot (worker/claims.py)
                freed |= left > ahead >= run.tokens_left()
            if out.prompt_tokens:
                run.prompt_tokens = out.prompt_tokens
                run.cached_tokens = out.cached_tokens
            if out.error is not None and out.error_code is not None:  # the job's own fault
                run.fail("failed", out.error_code, _own_fault(run, out.error))
            elif out.error is not None:
                run.retry_error = out.error  # handed back after its tokens are flushed
            elif out.stopped is not None:
                self._stopped(run, out.stopped)
            elif out.finish_reason is not None:
                self._finish(run, out.finish_reason)
            if run.end is not None or run.checking:
                # The engine keeps the prompt's and the reply's pages: the flush that writes
                # this end tells the gateways first (worker/news.py).
                st.cache.touch([*run.spec.input_ids, *run.resumed_ids, *run.token_ids])
                st.pace.ended(run.id, time.time() - run.started_wall)
            elif run.retry_error is not None:
                st.pace.ended(run.id, None)
            if run.end is not None or run.retry_error is not None or run.checking:
                # A batch job's plain end waits for its flush; a stop or failure does not.
                if not batch or out.finish_reason is None or out.error is not None:
                    st.urgent.add(run.id)
                freed = True
            st.dirty.add(out.job_id)
        if freed:  # slots are the engine's again, or soon: claims may start beside the flush
            st.room.set()
        if st.runner is not None and st.runner.failures >= _MAX_ENGINE_FAILURES:
            log.error("engine keeps failing; stopping", extra={"worker_id": st.id})
            st.healthy = False
            st.stopping.set()

    def _finish(self, run: RunningJob, reason: FinishReason) -> None:
        """The engine ended the job: its end now, or, under a JSON schema, once its output is
        checked (in the validators' thread: a large schema's first check takes tens of
        milliseconds, which the flush of every other job does not wait for)."""
        if not self.st.validators.wanted(run.spec.constraint):
            run.finish(reason)
            return
        run.checking = True
        task = asyncio.create_task(self._checked(run, reason))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _checked(self, run: RunningJob, reason: FinishReason) -> None:
        try:
            check = await self.st.validators.check_off_loop(run.spec.constraint, run.text())
        except Exception as exc:  # the job still ends: a check that broke is no verdict
            log.exception("output check failed", extra={"job_id": run.id})
            check = SchemaCheck(valid=None, errors=[f"the output could not be checked: {exc}"])
        # its end is made by the flush loop (`_collect`), never while a flush is in flight:
        # that flush would take the end for written when it was not
        self._ends.append((run, reason, check))
        self._flush_soon(run.id)

    def _checked_ends(self) -> None:
        """The ends of jobs whose outputs were checked since the last flush."""
        ends, self._ends = self._ends, []
        for run, reason, check in ends:
            if self.st.running.get(run.id) is run and run.checking:  # still ours
                run.finish(reason, check)

    @staticmethod
    def _stopped(run: RunningJob, stop: Stop) -> None:
        if stop.kind == "expired":
            run.fail("expired", "deadline_exceeded", "the job's timeout passed while it ran")
        elif stop.kind == "cancelled":
            run.cancelled(stop.reason or "cancelled")
        # dropped: the job has left this worker already; `_collect` never gets here for it

    async def _timed_flush(self, job_ids: set[str]) -> None:
        """`_flush`, timed: the engine's outputs wait for it to be read (worker/lead.py)."""
        began = time.monotonic()
        await self._flush(job_ids)
        self.st.lead.flushed(time.monotonic() - began)

    async def _flush(self, job_ids: set[str]) -> None:
        """One pipeline: these jobs' pending events, with their record fields if they ended."""
        st = self.st
        s = st.settings
        order: Written = []
        calls: list[Call[EmitReply]] = []
        retries: list[RunningJob] = []
        st.dirty -= job_ids
        st.urgent -= job_ids
        for job_id in job_ids:
            run = st.running.get(job_id)
            if run is None:
                continue
            events = run.take_events()
            if run.end is None and not events:
                if run.retry_error is not None:
                    retries.append(run)
                continue
            calls.append(
                st.transitions.emit(
                    job_id,
                    worker=st.id,
                    attempt=run.attempt,
                    events=events,
                    maxlen=s.event_log_maxlen,
                    fields=run.end,
                    retention_s=s.retention_s if run.end is not None else 0,
                    # its end acknowledges its queue entry in the same step
                    entry=None if run.end is None else (run.claim.queue, run.claim.entry_id),
                )
            )
            order.append((run, events))
        if retries:
            await self._retry(retries)
        if not order:
            return
        news = self.news.call()
        try:
            # Per-call errors come back in place: one job's rejected write must not fail
            # (and so retry forever) the flush of every other job in the pipeline. The news
            # goes first: a gateway hears where the prompt is cached before the job's end.
            results = await st.scripts.run_all(calls if news is None else [news, *calls])
            if news is not None:
                results = results[1:]
        except (RedisError, OSError) as exc:
            await self._failed(order, exc)
            return
        ended, lost_tail = self._apply(order, results)
        for run, events, last in lost_tail:
            await self._repair(run, events, last)
        if ended:  # their entries were acknowledged by the writes that ended them
            st.room.set()

    async def _failed(self, order: Written, exc: Exception) -> None:
        """Nothing is lost: the events go again (the scripts skip seqs already written)."""
        log.log(failure_level(self.st.redis), "flush failed; retrying", extra={"error": str(exc)})
        for run, events in order:
            run.put_back(events)
            self.st.dirty.add(run.id)
        await asyncio.sleep(_FLUSH_RETRY_S)
        self.st.flush_wanted.set()

    def _apply(
        self, order: Written, results: list[EmitReply | Exception]
    ) -> tuple[list[Claim], list[tuple[RunningJob, list[EncodedEvent], int]]]:
        """Act on each job's reply; return the claims of jobs that ended, and the jobs whose
        log lost its tail (repaired by the caller, which may await)."""
        st = self.st
        ended: list[Claim] = []
        lost_tail: list[tuple[RunningJob, list[EncodedEvent], int]] = []
        refused: Written = []
        for (run, events), reply in zip(order, results, strict=True):
            if isinstance(reply, Exception) and is_transient(reply):
                refused.append((run, events))  # Redis is busy, full or restarting: again later
            elif isinstance(reply, Exception):  # refused for what it is (a damaged key)
                log.error("Redis rejected events", extra={"job_id": run.id, "error": str(reply)})
                run.end, run.retry_error = None, f"Redis rejected the job's events: {reply}"
                run.ending = None
                self._flush_soon(run.id)  # handed back (counted) at the next flush
            elif isinstance(reply, LostTail):  # Redis lost the end of the log: nothing written
                lost_tail.append((run, events, reply.last))
            elif isinstance(reply, Fenced):  # another worker owns this job now
                log.warning("lost ownership; dropping job", extra={"job_id": run.id})
                st.drop(run.id)
            elif run.end is not None:
                run.remember(events, st.settings.log_repair_window_s)
                st.metrics.ended(run)
                st.finish(run)
                joblog.ended(st, run)
                ended.append(run.claim)
            else:
                run.remember(events, st.settings.log_repair_window_s)
                if reply.cancel is not None:  # asked while the control channel was away
                    st.cancel(run.id, reply.cancel)
                if run.retry_error is not None:  # its tokens are out: hand it back next flush
                    self._flush_soon(run.id)
        if refused:
            self._keep(refused, results)
        return ended, lost_tail

    def _keep(self, refused: Written, results: list[EmitReply | Exception]) -> None:
        """Writes Redis refused for now (OOM, LOADING, READONLY, BUSY, a reconnect): the
        events go back in front of what the job produced since and are sent again after a
        pause; the job's end, if it had one, stays. No attempt is counted."""
        error = next(str(r) for r in results if isinstance(r, Exception))
        log.warning(
            "Redis refused events for now; keeping them",
            extra={"jobs": len(refused), "error": error},
        )
        for run, events in refused:
            run.put_back(events)
        loop = asyncio.get_running_loop()
        loop.call_later(_FLUSH_RETRY_S, self._retry_refused, [r.id for r, _ in refused])

    def _retry_refused(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            if job_id in self.st.running:
                self._flush_soon(job_id)

    async def _repair(self, run: RunningJob, events: list[EncodedEvent], last: int) -> None:
        """The job's log ends at `last`, short of what this worker wrote (Redis restarted
        without its last writes): write the lost events again, from memory, so readers see
        exactly what live subscribers saw. Past the repair window, hand the job back: the
        next attempt continues from what the log holds."""
        st = self.st
        missing = run.written_after(last)
        if missing is None:
            log.warning("job log lost beyond repair; handing back", extra={"job_id": run.id})
            st.drop(run.id)
            with contextlib.suppress(RedisError, OSError):
                await hand_back(st, run, counted=False, why="its log was lost beyond repair")
            return
        log.warning("job log lost its tail; re-sending", extra={"job_id": run.id, "from": last})
        run.put_back(missing + events)
        self._flush_soon(run.id)

    def _flush_soon(self, job_id: str) -> None:
        """Flush this job at once, not at the next flush interval."""
        self.st.dirty.add(job_id)
        self.st.urgent.add(job_id)
        self.st.flush_wanted.set()

    async def _retry(self, runs: list[RunningJob]) -> None:
        """Jobs that failed (in the engine, or Redis rejected their writes): back to the queue
        for another attempt (counted by START, which dead-letters them once spent)."""
        st = self.st
        for run in runs:
            st.drop(run.id)  # the engine may still hold it (a write Redis rejected)
            log.warning(
                "job failed; handing it back",
                extra={"job_id": run.id, "attempt": run.attempt, "error": run.retry_error},
            )
            st.metrics.attempt_failures.inc()
            try:
                await hand_back(st, run, counted=True, error=run.retry_error or "")
            except (RedisError, OSError) as exc:  # still ours in the PEL: reclaimed later
                log.warning("hand-back failed", extra={"job_id": run.id, "error": str(exc)})
        st.room.set()


def _own_fault(run: RunningJob, error: str) -> str:
    """An engine's error about what the job itself asked, naming the request field it is
    about (`regex`, `json_schema`, `grammar`, `response_format`, `tools`)."""
    constraint = run.spec.constraint
    field = constraint.field if constraint is not None else "the request"
    return f"{field}: {error} (not retried: any worker would fail it the same way)"
