"""The engine thread: the only caller of the engine. Talks to asyncio through two queues.

inbox  (asyncio → thread): jobs to add, cancels; each for one attempt of a job.
outbox (thread → asyncio): the StepOutputs of each step, drained by the flush loop, which
    is woken at most once per drain (not once per step) so a fast engine cannot flood the loop.

Engines know jobs by id; attempts are the runner's. It tags every output with the attempt
the engine is running for that job, and applies a cancel only to the attempt it names, so
nothing meant for one attempt can touch another: a job handed back and claimed again by
this worker is cancelled (old attempt) and added (new one) in order, and the old attempt's
late outputs carry its number, which the worker no longer runs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.engine import Engine, EngineJob, StepOutput, Stop

log = logging.getLogger(__name__)
FAILURE_BACKOFF_S = 0.05
FAILURE_BACKOFF_MAX_S = 1.0
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class _Add:
    job: EngineJob
    attempt: int


@dataclass(frozen=True, slots=True)
class _Cancel:
    job_id: str
    attempt: int
    stop: Stop


class EngineRunner:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]):
        self.engine = engine
        self._loop = loop
        self._wake = wake
        self._inbox: collections.deque[_Add | _Cancel] = collections.deque()
        self._outbox: collections.deque[StepOutput] = collections.deque()
        self._cond = threading.Condition()
        self._woken = False
        self._stop = False
        self._attempts: dict[str, int] = {}
        """Engine thread only: the attempt of each job the engine holds."""
        self.failures = 0
        self.tokens = 0
        self._thread = threading.Thread(target=self._run, name="genq-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    def add(self, job: EngineJob, attempt: int) -> None:
        self._post(_Add(job, attempt))

    def cancel(self, job_id: str, attempt: int, stop: Stop) -> None:
        """Stop that attempt of the job; its last output comes back with `stopped` set."""
        self._post(_Cancel(job_id, attempt, stop))

    def drain(self) -> list[StepOutput]:
        """Everything produced since the last drain (called on the asyncio side)."""
        self._woken = False
        out = []
        while self._outbox:
            out.append(self._outbox.popleft())
        return out

    def _post(self, item: _Add | _Cancel) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    def _emit(self, outputs: list[StepOutput]) -> None:
        self._outbox.extend(outputs)
        if not self._woken:
            self._woken = True
            self._loop.call_soon_threadsafe(self._wake)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._inbox and self.engine.active() == 0:
                    self._cond.wait()
                if self._stop:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
            self._apply(commands)
            if self.engine.active():
                self._step()

    def _apply(self, commands: list[_Add | _Cancel]) -> None:
        outputs: list[StepOutput] = []
        for c in commands:
            if isinstance(c, _Add):
                outputs += self._add(c)
            elif self._attempts.get(c.job_id) == c.attempt:
                del self._attempts[c.job_id]
                if self.engine.cancel(c.job_id):
                    outputs.append(StepOutput(c.job_id, attempt=c.attempt, stopped=c.stop))
        if outputs:
            self._emit(outputs)

    def _add(self, c: _Add) -> list[StepOutput]:
        job_id = c.job.id
        if job_id in self._attempts:  # an older attempt still in the engine: it goes first
            self.engine.cancel(job_id)
        self._attempts[job_id] = c.attempt
        try:
            self.engine.add(c.job)
        except Exception as exc:  # a job the engine refuses fails alone
            del self._attempts[job_id]
            log.warning("engine refused job", extra={"job_id": job_id, "error": str(exc)})
            return [StepOutput(job_id, error=f"engine refused the job: {exc}", attempt=c.attempt)]
        return []

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.failures += 1
            log.exception("engine step failed", extra={"failures": self.failures})
            self._emit(self._fail_all(exc))
            time.sleep(min(FAILURE_BACKOFF_S * self.failures, FAILURE_BACKOFF_MAX_S))
            return
        self.failures = 0
        for out in outputs:
            out.attempt = self._attempts.get(out.job_id, 0)
            if out.finish_reason is not None or out.error is not None:
                self._attempts.pop(out.job_id, None)
        if outputs:
            self.tokens += sum(len(o.token_ids) for o in outputs)
            self._emit(outputs)

    def _fail_all(self, exc: Exception) -> list[StepOutput]:
        """After a failed step no job's state can be trusted: end them all with an error."""
        error = f"engine step failed: {exc}"
        out = [
            StepOutput(i, error=error, attempt=self._attempts.get(i, 0))
            for i in self.engine.reset()
        ]
        self._attempts.clear()
        return out
