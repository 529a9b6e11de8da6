"""A running job as the worker sees it: what it has sent, what it still owes Redis."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shared import events
from shared.constraints import SchemaCheck
from shared.events import CancelledEvent, DoneEvent, ErrorEvent, Event, StartedEvent, TokenEvent
from shared.records import JobRecord
from shared.schemas import ErrorInfo, FinishReason, JobResult, JobSpec, Timings, Usage
from shared.transitions import EncodedEvent
from worker.engine import Stop


@dataclass(slots=True)
class Claim:
    """A queue entry this worker holds in the stream's pending list."""

    entry_id: str
    queue: str
    job_id: str
    need_tokens: int
    owner: str | None = None
    """Who submitted the job (a hash of their key), carried into a re-queued entry."""


@dataclass(frozen=True, slots=True)
class Ending:
    """How a job ended here, as its end's record fields say it (for its log line)."""

    status: str
    usage: Usage
    timings: Timings
    finish_reason: FinishReason | None = None
    detail: str | None = None
    """The error code of a failed or expired job; the reason of a cancelled one."""


def _written_after(
    recent: deque[tuple[float, list[EncodedEvent]]], last_seq: int
) -> list[EncodedEvent] | None:
    out = [e for _, written in recent for e in written if e[0] > last_seq]
    if not out or out[0][0] != last_seq + 1:
        return None
    return out


@dataclass(frozen=True, slots=True)
class FinishedJob:
    """A job whose end this worker wrote, as kept for the repair window (worker/repair.py):
    enough to write its end again, nothing more."""

    id: str
    claim: Claim
    attempt: int
    seq: int
    """Its last seq."""
    end: dict[str, str] | None
    """The record fields of its end."""
    recent: deque[tuple[float, list[EncodedEvent]]]
    """(monotonic time, events) of its flushes within the window."""

    def written_after(self, last_seq: int) -> list[EncodedEvent] | None:
        """As `RunningJob.written_after`."""
        return _written_after(self.recent, last_seq)


@dataclass(slots=True)
class RunningJob:
    spec: JobSpec
    claim: Claim
    attempt: int
    seq: int
    """Last seq given to an event (written or pending)."""
    started_wall: float
    resumed_ids: list[int] = field(default_factory=list)
    first_token_wall: float | None = None
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pending: list[EncodedEvent] = field(default_factory=list)
    """Events waiting for the next flush."""
    acc_text: list[str] = field(default_factory=list)
    acc_ids: list[int] = field(default_factory=list)
    acc_logprobs: list[dict[str, Any]] | None = None
    end: dict[str, str] | None = None
    """The record fields of its end (status among them), once the job has ended locally."""
    ending: Ending | None = None
    """The same end, unencoded (worker/joblog.py)."""
    retry_error: str | None = None
    """Set when the engine failed the job: it goes back to the queue for another attempt."""
    stop: Stop | None = None
    """Set once the worker asked the engine to stop the job (cancel, deadline)."""
    recent: deque[tuple[float, list[EncodedEvent]]] = field(default_factory=deque)
    """(monotonic time, events) of recent successful flushes, to repair the log."""
    last_output_s: float = 0.0
    """perf_counter of its last tokens from the engine (the inter-token latency metric)."""
    outcome: str | None = None
    """How it ended here: its finish reason (stop, length), or cancelled, failed, expired."""
    ended_wall: float | None = None
    """When it ended here (unix time): the metrics' end-to-end and decode times end there."""
    checking: bool = False
    """The engine is done with it; its output is being checked against its JSON schema
    (worker/output_check.py) before its end is written."""
    unwritten_since: float | None = None
    """Monotonic time of its oldest tokens not written yet: a batch job's events wait for
    them to age (worker/flush.py)."""

    @property
    def id(self) -> str:
        return self.spec.id

    def tokens_left(self) -> int:
        """Tokens it may still make: flushed, and taken from the engine since."""
        return self.spec.max_tokens - len(self.token_ids) - len(self.acc_ids)

    def _push(self, event: Event) -> None:
        self.pending.append((event.seq, events.encode(event)))

    def remember(self, written: list[EncodedEvent], window_s: float) -> None:
        """Keep what a flush wrote for `window_s`, in case Redis loses it."""
        now = time.monotonic()
        if written and window_s > 0:
            self.recent.append((now, written))
        while self.recent and now - self.recent[0][0] > window_s:
            self.recent.popleft()

    def written_after(self, last_seq: int) -> list[EncodedEvent] | None:
        """The remembered events from `last_seq + 1` on; None if they do not reach back that
        far (the log's lost tail is older than the repair window)."""
        return _written_after(self.recent, last_seq)

    def finished(self) -> FinishedJob:
        """What its end leaves behind for the repair window: none of its prompt, tokens or
        buffers (a worker under load ends hundreds of jobs within the window)."""
        return FinishedJob(self.id, self.claim, self.attempt, self.seq, self.end, self.recent)

    def started(self, worker_id: str) -> None:
        self.seq += 1
        ev = StartedEvent(
            seq=self.seq,
            attempt=self.attempt,
            worker=worker_id,
            resumed_tokens=len(self.resumed_ids),
        )
        self._push(ev)

    def add_tokens(self, text: str, ids: list[int], logprobs: list[dict[str, Any]] | None) -> None:
        if self.first_token_wall is None:
            self.first_token_wall = time.time()
        if self.unwritten_since is None:
            self.unwritten_since = time.monotonic()
        self.acc_text.append(text)
        self.acc_ids.extend(ids)
        if logprobs:
            self.acc_logprobs = (self.acc_logprobs or []) + logprobs

    def take_events(self) -> list[EncodedEvent]:
        """The pending events, with accumulated tokens folded into one event."""
        self._fold_tokens()
        out, self.pending = self.pending, []
        self.unwritten_since = None
        return out

    def put_back(self, events: list[EncodedEvent]) -> None:
        """Events a flush could not write: in front of what came since, for the next flush
        (old enough for a batch job's: they waited once already)."""
        self.pending[:0] = events
        self.unwritten_since = -math.inf

    def _fold_tokens(self) -> None:
        if self.acc_ids or self.acc_text:
            text = "".join(self.acc_text)
            self.seq += 1
            ev = TokenEvent(
                seq=self.seq,
                attempt=self.attempt,
                text=text,
                token_ids=self.acc_ids,
                count=len(self.acc_ids),
                logprobs=self.acc_logprobs,
            )
            self._push(ev)
            self.text_parts.append(text)
            self.token_ids.extend(self.acc_ids)
            self.acc_text, self.acc_ids, self.acc_logprobs = [], [], None

    def text(self) -> str:
        """Everything it generated so far (earlier attempts' text too), flushed or not."""
        return "".join(self.text_parts) + "".join(self.acc_text)

    def finish(self, reason: FinishReason, schema_check: SchemaCheck | None = None) -> None:
        """End with 'stop' or 'length': the done event and the result go out at the next flush
        (under a JSON schema, with how the output stands against it)."""
        self._fold_tokens()
        self.checking = False
        now = self._ended(reason)
        usage, timings = self._usage(), self._timings(now)
        result = self._result(reason)
        result.schema_check = schema_check
        self.seq += 1
        done = DoneEvent(
            seq=self.seq,
            attempt=self.attempt,
            finish_reason=reason,
            usage=usage,
            timings=timings,
            schema_check=result.schema_check,
        )
        self._push(done)
        self.end = JobRecord.fields(
            status="succeeded",
            finished_at=now,
            result=result,
            usage=usage,
            timings=timings,
        )
        self.ending = Ending("succeeded", usage, timings, finish_reason=reason)

    def fail(self, status: str, code: str, message: str) -> None:
        """End with an `error` event (status 'failed' or 'expired'), keeping what it generated."""
        self._fold_tokens()
        self._ended(status)
        self.seq += 1
        self._push(ErrorEvent(seq=self.seq, attempt=self.attempt, code=code, message=message))
        error = ErrorInfo(code=code, message=message)
        partial = self._partial_fields()
        self.end = JobRecord.fields(status=status, error=error, **partial)
        self.ending = Ending(status, partial["usage"], partial["timings"], detail=code)

    def cancelled(self, reason: str) -> None:
        """End with a `cancelled` event, keeping what it generated."""
        self._fold_tokens()
        self._ended("cancelled")
        self.seq += 1
        ev = CancelledEvent(seq=self.seq, attempt=self.attempt, reason=reason)
        self._push(ev)
        partial = self._partial_fields()
        self.end = JobRecord.fields(status="cancelled", **partial)
        self.ending = Ending("cancelled", partial["usage"], partial["timings"], detail=reason)

    def _ended(self, outcome: str) -> float:
        """Note how and when it ended (worker/metrics.py records it once its end is written)."""
        self.outcome, self.ended_wall = outcome, time.time()
        return self.ended_wall

    def _partial_fields(self) -> dict[str, Any]:
        """The record fields of a job stopped before it finished: its text so far (no finish
        reason), usage and timings."""
        now = time.time()
        return {
            "finished_at": now,
            "result": self._result(None),
            "usage": self._usage(),
            "timings": self._timings(now),
        }

    def _result(self, reason: FinishReason | None) -> JobResult:
        ids = self.resumed_ids + self.token_ids  # as the text: earlier attempts' too
        return JobResult(text="".join(self.text_parts), token_ids=ids, finish_reason=reason)

    def _usage(self) -> Usage:
        prompt = self.prompt_tokens or len(self.spec.input_ids)
        completion = len(self.resumed_ids) + len(self.token_ids)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            cached_tokens=self.cached_tokens,
        )

    def _timings(self, now: float) -> Timings:
        first = self.first_token_wall
        return Timings(
            queue_s=round(self.started_wall - self.spec.created_at, 6),
            ttft_s=round(first - self.spec.created_at, 6) if first else None,
            generation_s=round(now - first, 6) if first else None,
        )
