"""The worker's side of its engine: what the asyncio phases call, whichever way the engine
runs — in an engine process of its own (`worker.engine_client.EngineProcess`, the default)
or on a thread of this process (`worker.runner.EngineRunner`, for tests).

Both take commands (add an attempt of a job, cancel one) and hand back the outputs of the
engine's steps (`drain`), and both keep here, on the worker's side, what the claim loop needs
without asking the engine: the model card, admission (worker/admission.py) and step timings.
With GENQ_DETOKENIZE=worker the job's text is made here too (worker/text.py): the engine
gets `EngineJob.text=False`, and a stop string found here cancels the job in the engine.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from shared.schemas import ModelCard
from worker import lead
from worker.admission import Admission
from worker.engine import EngineJob, StepOutput, Stop
from worker.text import Detokenizer, TextStream

STOP_STRING = Stop("dropped", "stop string")
"""How the worker stops a job in the engine once it matched a stop string: the job has ended
here already (finish reason `stop`), so its confirmation carries nothing to write."""


@dataclass(slots=True)
class StepTimes:
    """Cumulative step timings: the engine's own `step()` and, as the worker sees them, the
    time from one step's outputs to the next's while the engine is busy; the difference is
    what the boundary costs per step."""

    steps: int = 0
    engine_s: float = 0.0
    intervals: int = 0
    interval_s: float = 0.0
    recent_s: float = 0.0
    """The step interval, recent steps weighing most (worker/lead.py)."""

    def interval(self, steps: int, seconds: float) -> None:
        """`steps` steps took `seconds`, from one step's outputs to the next's."""
        self.intervals += steps
        self.interval_s += seconds
        if steps > 0 and seconds > 0:
            self.recent_s = lead.mix(self.recent_s, seconds / steps)

    def snapshot(self) -> StepTimes:
        return dataclasses.replace(self)


class EngineLink(abc.ABC):
    def __init__(
        self, card: ModelCard, tokenizer_json: str, admission: Admission, detokenize: bool
    ) -> None:
        self.card = card
        self.tokenizer_json = tokenizer_json
        self.admission = admission
        self._detokenizer = Detokenizer(tokenizer_json) if detokenize else None
        self._streams: dict[str, tuple[int, TextStream]] = {}
        """Per job (worker-made text): the attempt it is made for, and its stream."""
        self.failures = 0
        """Consecutive engine failures: failed steps, engine process deaths and stalls."""
        self.tokens = 0
        self.times = StepTimes()
        self.down: str | None = None
        """Why the engine cannot take jobs now (its process is restarting), or None."""
        self.changed = asyncio.Event()
        """Set whenever `down` changes."""
        self.restarts = 0
        """Times the engine process was restarted."""
        self.prefill_side_by_side = False
        """The engine prefills its jobs side by side (`worker.engine.prefill_side_by_side`)."""
        self.engine_free_slots = admission.max_batch
        """Batch slots free in the engine as it last said (the worker counts its own)."""
        self._wake: Callable[[], None] = lambda: None

    @property
    def max_batch(self) -> int:
        return self.admission.max_batch

    @property
    def pid(self) -> int | None:
        """The engine process's id; None when the engine runs in this process."""
        return None

    @abc.abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        """Begin delivering outputs; `wake` is called (on the loop) when there are some."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop the engine (every job in it) and let go of it."""

    def fits(self, need_tokens: int, active: int, slots: int | None = None) -> bool:
        return self.down is None and self.admission.fits(need_tokens, active, slots)

    def add(self, job: EngineJob, attempt: int, limit: int = 0) -> None:
        """Start that attempt of the job; `limit`: it joins the engine only while the engine
        holds fewer jobs, and waits at the engine's doorstep until then (worker/core.py)."""
        if self._detokenizer is not None:
            stream = self._detokenizer.stream(job.sampling.stop, job.input_ids, job.resume_ids)
            self._streams[job.id] = (attempt, stream)
            job = dataclasses.replace(job, text=False)
        self.admission.sent(len(job.input_ids) + job.max_tokens)
        self._send_add(job, attempt, limit)

    def cancel(self, job_id: str, attempt: int, stop: Stop) -> None:
        """Stop that attempt of the job; its last output comes back with `stopped` set."""
        self._send_cancel(job_id, attempt, stop)

    def drain(self) -> list[StepOutput]:
        """Everything the engine produced since the last drain (called on the asyncio side)."""
        outputs = self._take()
        if self._detokenizer is None:
            return outputs
        return [o for o in outputs if self._make_text(o)]

    def _make_text(self, out: StepOutput) -> bool:
        """Give `out` its text; False to drop it (the job ended here on a stop string)."""
        entry = self._streams.get(out.job_id)
        if entry is None or entry[0] != out.attempt:
            return True  # an attempt the worker no longer runs: it ignores the output
        stream = entry[1]
        if out.finish_reason is not None or out.error is not None or out.stopped is not None:
            del self._streams[out.job_id]
        if stream.done:
            return False
        if out.error is not None or out.stopped is not None:
            return True
        out.text, keep = stream.feed(out.token_ids, out.finish_reason is not None)
        if stream.done:
            del out.token_ids[keep:]
            if out.logprobs is not None:
                del out.logprobs[keep:]
            if out.finish_reason is None:  # still running in the engine: stop it there
                self.cancel(out.job_id, out.attempt, STOP_STRING)
            out.finish_reason = "stop"
        return True

    def _forget_streams(self) -> None:
        self._streams.clear()

    @abc.abstractmethod
    def _send_add(self, job: EngineJob, attempt: int, limit: int) -> None: ...

    @abc.abstractmethod
    def _send_cancel(self, job_id: str, attempt: int, stop: Stop) -> None: ...

    @abc.abstractmethod
    def _take(self) -> list[StepOutput]:
        """The outputs delivered since the last call."""
