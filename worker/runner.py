"""The engine on a thread of the worker's own process: the in-process `EngineLink`, for tests
and tools that hold an engine object (`Worker(settings, SimEngine(...))`). Workers started
from the command line run their engine in a process of its own (worker/engine_client.py).

inbox  (asyncio → thread): jobs to add, cancels; each for one attempt of a job.
outbox (thread → asyncio): the StepOutputs of each step, drained by the flush loop, which
    is woken at most once per drain (not once per step) so a fast engine cannot flood the loop.
The attempts, cancels and failed steps are the core's (worker/core.py), as in the engine
process.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable

from worker.admission import Admission
from worker.core import AddCommand, CancelCommand, Command, EngineCore
from worker.engine import (
    Engine,
    EngineJob,
    StepOutput,
    Stop,
    prefill_side_by_side,
    reserved_tokens,
)
from worker.link import EngineLink

STOP_TIMEOUT_S = 5.0


class EngineRunner(EngineLink):
    def __init__(self, engine: Engine, *, detokenize: bool = False) -> None:
        admission = Admission(
            engine.max_batch,
            engine.page_size,
            engine.total_pages,
            engine.free_pages(),
            reserved_tokens(engine),
        )
        super().__init__(engine.card, engine.tokenizer_json, admission, detokenize)
        self.prefill_side_by_side = prefill_side_by_side(engine)
        self.engine = engine
        self._core = EngineCore(engine)
        self._inbox: collections.deque[Command] = collections.deque()
        self._outbox: collections.deque[StepOutput] = collections.deque()
        self._cond = threading.Condition()
        self._woken = False
        self._stop = False
        self._report = (admission.free_pages, 0)
        """(free pages, adds applied) as the engine thread last saw them."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="genq-engine", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._loop = loop
        self._wake = wake
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.stop)
        self.engine.close()

    def fits(self, need_tokens: int, active: int, slots: int | None = None) -> bool:
        self.admission.report(*self._report)
        return super().fits(need_tokens, active, slots)

    def _send_add(self, job: EngineJob, attempt: int, limit: int) -> None:
        self._post(AddCommand(job, attempt, limit))

    def _send_cancel(self, job_id: str, attempt: int, stop: Stop) -> None:
        self._post(CancelCommand(job_id, attempt, stop))

    def _take(self) -> list[StepOutput]:
        self._woken = False
        out = []
        while self._outbox:
            out.append(self._outbox.popleft())
        return out

    def _post(self, item: Command) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    # ---- the engine thread ----------------------------------------------------------------

    def _emit(self, outputs: list[StepOutput]) -> None:
        self._outbox.extend(outputs)
        if not self._woken and self._loop is not None:
            self._woken = True
            self._loop.call_soon_threadsafe(self._wake)

    def _run(self) -> None:
        core = self._core
        last_step: float | None = None
        while True:
            with self._cond:
                if not self._stop and not self._inbox and self._idle():
                    last_step = None  # idle: the next step's interval starts afresh
                    while not self._stop and not self._inbox and self._idle():
                        self._cond.wait()
                if self._stop:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
            outputs = core.apply(commands)
            if self.engine.active():
                outputs += core.step()
                last_step = self._count_step(last_step)
            self._report = (self.engine.free_pages(), core.adds)
            self.engine_free_slots = self.engine.max_batch - self.engine.active()
            self.failures, self.tokens = core.failures, core.tokens
            if outputs:
                self._emit(outputs)

    def _idle(self) -> bool:
        return self.engine.active() == 0 and self._core.waiting() == 0

    def _count_step(self, last_step: float | None) -> float:
        now = time.perf_counter()
        t = self.times
        t.steps += 1
        t.engine_s += self._core.last_step_s
        if last_step is not None:
            t.interval(1, now - last_step)
        return now
