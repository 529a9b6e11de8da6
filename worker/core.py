"""What runs around an engine on its own thread: attempts, commands, failed steps. Used by the
engine process (worker/engine_process.py) and by the in-process runner (worker/runner.py).

Engines know jobs by id; attempts are the core's. It tags every output with the attempt the
engine is running for that job, and applies a cancel only to the attempt it names, so
nothing meant for one attempt can touch another: a job handed back and claimed again by
this worker is cancelled (old attempt) and added (new one) in order, and the old attempt's
late outputs carry its number, which the worker no longer runs.

The doorstep: an add may name a `limit`, the jobs the engine may hold when it joins (a batch
job's leaves the worker's interactive reserve free). An add that arrives while the engine
holds that many waits here, in order, and joins the engine as soon as a step has ended jobs
enough, before the next step: the worker starts a few jobs ahead of the slots that are
about to come free (worker/claims.py), and a slot a job leaves is taken at the next step,
not a Redis round trip and a socket hop later. A waiting add is cancelled like a running
job (its `stopped` output), and counts as applied (`adds`) once it has joined or left.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from worker.engine import Engine, EngineJob, JobRefused, StepOutput, Stop

log = logging.getLogger(__name__)
FAILURE_BACKOFF_S = 0.05
FAILURE_BACKOFF_MAX_S = 1.0


@dataclass(frozen=True, slots=True)
class AddCommand:
    job: EngineJob
    attempt: int
    limit: int = 0
    """Join only while the engine holds fewer jobs than this (0: its max batch)."""


@dataclass(frozen=True, slots=True)
class CancelCommand:
    job_id: str
    attempt: int
    stop: Stop


Command = AddCommand | CancelCommand


class EngineCore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._attempts: dict[str, int] = {}
        """The attempt of each job the engine holds."""
        self._waiting: collections.deque[tuple[int, AddCommand]] = collections.deque()
        """(its number, the add) of adds waiting at the doorstep, in order."""
        self._received = 0
        """Add commands received so far."""
        self.failures = 0
        """Consecutive failed steps."""
        self.tokens = 0
        self.last_step_s = 0.0
        """How long the last `step()` of the engine took."""

    @property
    def adds(self) -> int:
        """Add commands applied so far, in order: every add up to this number has joined the
        engine, been refused, or left the doorstep (the worker's admission counts its page
        promises by it; one that passed the doorstep's queue counts once those before it
        have)."""
        return self._waiting[0][0] - 1 if self._waiting else self._received

    def waiting(self) -> int:
        """Adds at the doorstep."""
        return len(self._waiting)

    def apply(self, commands: list[Command]) -> list[StepOutput]:
        """The commands in order; then the adds at the doorstep that the engine has room for
        join it."""
        outputs: list[StepOutput] = []
        for c in commands:
            if isinstance(c, AddCommand):
                self._received += 1
                self._leave_doorstep(c.job.id)  # an older attempt still waiting: it goes
                self._waiting.append((self._received, c))
            elif self._attempts.get(c.job_id) == c.attempt:
                del self._attempts[c.job_id]
                if self.engine.cancel(c.job_id):
                    outputs.append(StepOutput(c.job_id, attempt=c.attempt, stopped=c.stop))
            elif self._leave_doorstep(c.job_id, c.attempt):
                outputs.append(StepOutput(c.job_id, attempt=c.attempt, stopped=c.stop))
        return outputs + self.admit()

    def admit(self) -> list[StepOutput]:
        """The waiting adds the engine has room for, in order (one whose limit is reached
        lets a later one with a higher limit pass)."""
        outputs: list[StepOutput] = []
        if not self._waiting:
            return outputs
        engine, kept = self.engine, collections.deque[tuple[int, AddCommand]]()
        full = engine.max_batch
        for n, c in self._waiting:
            limit = min(c.limit, full) if c.limit > 0 else full
            if engine.active() < limit:
                outputs += self._add(c)
            else:
                kept.append((n, c))
        self._waiting = kept
        return outputs

    def _leave_doorstep(self, job_id: str, attempt: int | None = None) -> bool:
        """Drop the job's add (of `attempt`, or any) from the doorstep; whether there was one."""
        gone = [
            (n, c)
            for n, c in self._waiting
            if c.job.id == job_id and (attempt is None or c.attempt == attempt)
        ]
        for entry in gone:
            self._waiting.remove(entry)
        return bool(gone)

    def _add(self, c: AddCommand) -> list[StepOutput]:
        job_id = c.job.id
        if job_id in self._attempts:  # an older attempt still in the engine: it goes first
            self.engine.cancel(job_id)
        self._attempts[job_id] = c.attempt
        try:
            self.engine.sampling_support.check(c.job.sampling)
            self.engine.add(c.job)
        except JobRefused as exc:  # the job's own fault: it fails at once, here
            del self._attempts[job_id]
            log.info("engine refused job", extra={"job_id": job_id, "error": str(exc)})
            return [StepOutput(job_id, error=str(exc), attempt=c.attempt, error_code=exc.code)]
        except Exception as exc:  # a job the engine refuses fails alone
            del self._attempts[job_id]
            log.warning("engine refused job", extra={"job_id": job_id, "error": str(exc)})
            return [StepOutput(job_id, error=f"engine refused the job: {exc}", attempt=c.attempt)]
        return []

    def step(self) -> list[StepOutput]:
        """One engine step, its outputs tagged. A failed step fails every job (after a pause
        that grows with consecutive failures)."""
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.last_step_s = time.perf_counter() - t0
            self.failures += 1
            log.exception("engine step failed", extra={"failures": self.failures})
            failed = self._fail_all(exc)
            time.sleep(min(FAILURE_BACKOFF_S * self.failures, FAILURE_BACKOFF_MAX_S))
            return failed
        self.last_step_s = time.perf_counter() - t0
        self.failures = 0
        attempts = self._attempts
        for out in outputs:
            out.attempt = attempts.get(out.job_id, 0)
            if out.finish_reason is not None or out.error is not None:
                attempts.pop(out.job_id, None)
            self.tokens += len(out.token_ids)
        return outputs

    def _fail_all(self, exc: Exception) -> list[StepOutput]:
        """After a failed step no job's state can be trusted: end them all with an error."""
        error = f"engine step failed: {exc}"
        out = [
            StepOutput(i, error=error, attempt=self._attempts.get(i, 0))
            for i in self.engine.reset()
        ]
        self._attempts.clear()
        return out
