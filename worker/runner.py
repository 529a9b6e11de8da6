"""The engine thread: the only caller of the engine. Talks to asyncio through two queues.

inbox  (asyncio → thread): jobs to add, ids to cancel.
outbox (thread → asyncio): the StepOutputs of each step, drained by the flush loop, which
    is woken at most once per drain (not once per step) so a fast engine cannot flood the loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable

from worker.engine import Engine, EngineJob, StepOutput

log = logging.getLogger(__name__)


class EngineRunner:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]):
        self.engine = engine
        self._loop = loop
        self._wake = wake
        self._inbox: collections.deque[tuple[str, EngineJob | str]] = collections.deque()
        self._outbox: collections.deque[StepOutput] = collections.deque()
        self._cond = threading.Condition()
        self._woken = False
        self._stop = False
        self.failures = 0
        self.tokens = 0
        self._thread = threading.Thread(target=self._run, name="genq-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    def add(self, job: EngineJob) -> None:
        self._post(("add", job))

    def cancel(self, job_id: str) -> None:
        self._post(("cancel", job_id))

    def drain(self) -> list[StepOutput]:
        """Everything produced since the last drain (called on the asyncio side)."""
        self._woken = False
        out = []
        while self._outbox:
            out.append(self._outbox.popleft())
        return out

    def _post(self, item: tuple[str, EngineJob | str]) -> None:
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

    def _apply(self, commands: list[tuple[str, EngineJob | str]]) -> None:
        outputs: list[StepOutput] = []
        for verb, arg in commands:
            if verb == "add":
                assert isinstance(arg, EngineJob)
                try:
                    self.engine.add(arg)
                except Exception as exc:  # a job the engine refuses fails alone
                    log.warning("engine refused job", extra={"job_id": arg.id, "error": str(exc)})
                    outputs.append(
                        StepOutput(job_id=arg.id, error=f"engine refused the job: {exc}")
                    )
            else:
                assert isinstance(arg, str)
                if self.engine.cancel(arg):
                    outputs.append(StepOutput(job_id=arg, finish_reason="cancelled"))
        if outputs:
            self._emit(outputs)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.failures += 1
            log.exception("engine step failed", extra={"failures": self.failures})
            self._emit(self._fail_all(exc))
            time.sleep(min(0.05 * self.failures, 1.0))
            return
        self.failures = 0
        if outputs:
            self.tokens += sum(len(o.token_ids) for o in outputs)
            self._emit(outputs)

    def _fail_all(self, exc: Exception) -> list[StepOutput]:
        """After a failed step no job's state can be trusted: end them all with an error."""
        return [
            StepOutput(job_id=i, error=f"engine step failed: {exc}") for i in self.engine.reset()
        ]
