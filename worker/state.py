"""What the worker's phases share: who it is, where it writes, the jobs it holds, and the
events by which one phase wakes another. Plain state, no Redis calls."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shared.keys import Keys, Priority
from shared.settings import WorkerSettings
from shared.transitions import ScriptRunner, Transitions
from worker.cachemodel import CacheModel
from worker.engine import Stop
from worker.jobstate import Claim, FinishedJob, RunningJob
from worker.lead import Lead
from worker.lease import LeaseClock
from worker.link import EngineLink
from worker.metrics import WorkerMetrics
from worker.output_check import Validators
from worker.pace import Pace

EARLY_CANCELS_KEPT = 1000
EARLY_CANCEL_TTL_S = 60.0


ENDINGS = ("succeeded", "failed", "expired", "cancelled")
"""The job ends StepCounts counts (each a field of it)."""


@dataclass(slots=True)
class StepCounts:
    """Job steps since the worker started (the summary logs their differences)."""

    started: int = 0
    succeeded: int = 0
    failed: int = 0
    expired: int = 0
    cancelled: int = 0
    requeued: int = 0
    dead_lettered: int = 0

    def count_end(self, status: str) -> None:
        if status in ENDINGS:
            setattr(self, status, getattr(self, status) + 1)


@dataclass(slots=True, eq=False)
class WorkerState:
    settings: WorkerSettings
    engine: EngineLink
    """The worker's side of its engine (its card, admission, commands and outputs)."""
    id: str
    model: str
    keys: Keys
    redis: aioredis.Redis
    scripts: ScriptRunner
    transitions: Transitions
    queues: dict[Priority, str]
    overflow: dict[Priority, str]
    """Per priority, beside its queue: jobs of owners past their fair share in flight."""
    placed: dict[Priority, str]
    """Per priority: this worker's own lane (placement: jobs its cache suits wait here)."""
    cache: CacheModel
    """What its engine's prefix cache holds (worker/cachemodel.py), published for placement."""
    lease: LeaseClock
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    pace: Pace = field(default_factory=Pace)
    """How fast its engine prefills and frees slots (worker/pace.py), published for placement."""
    lead: Lead = field(default_factory=Lead)
    """How long a claim takes to reach the engine (worker/lead.py): how far ahead batch claims
    start."""
    running: dict[str, RunningJob] = field(default_factory=dict)
    waiting: list[Claim] = field(default_factory=list)
    """Claimed, not STARTed yet (the engine had no room, or START has not run)."""
    dirty: set[str] = field(default_factory=set)
    urgent: set[str] = field(default_factory=set)
    """Dirty jobs whose events should not wait for the flush interval."""
    finished: OrderedDict[str, tuple[float, FinishedJob]] = field(default_factory=OrderedDict)
    """Jobs whose end this worker wrote within the repair window (job id → (monotonic time,
    job)): if Redis loses those writes (a restart without its last second), the worker
    writes them again from memory instead of the job running again. Ordered: a dict whose
    oldest entries go one by one finds its first entry past every deleted slot (microseconds
    a job at thousands of jobs in the window)."""
    early_cancels: dict[str, float] = field(default_factory=dict)
    """Cancels that arrived before the job's START reply (job id → when)."""
    flush_wanted: asyncio.Event = field(default_factory=asyncio.Event)
    room: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    """Set with `stopping` to drain without waiting for running jobs (they go back at once)."""
    closing: bool = False
    healthy: bool = True
    counts: StepCounts = field(default_factory=StepCounts)
    """Job steps so far (worker/joblog.py), for the summary line."""
    validators: Validators = field(default_factory=Validators)
    """JSON schema validators, for the outputs of jobs under one (worker/output_check.py)."""
    shard: int = 0
    """The queue shard `queues`, `overflow` and `placed` are of now (`next_shard`)."""

    @property
    def runner(self) -> EngineLink:
        """The engine, as the phases that command it and drain it name it."""
        return self.engine

    def forget(self, job_id: str) -> RunningJob | None:
        """A job whose end is written (or that never reached the engine) leaves this worker."""
        self.pace.ended(job_id, None)
        return self.running.pop(job_id, None)

    def finish(self, run: RunningJob) -> None:
        """Its end is written: it leaves the running jobs; what a repair needs of it is kept a
        while."""
        self.running.pop(run.id, None)
        if self.settings.log_repair_window_s > 0:
            self.finished[run.id] = (time.monotonic(), run.finished())
        self.forget_finished()

    def forget_finished(self) -> None:
        """Drop the finished jobs older than the repair window (called at each end, and by
        the heartbeat, so an idle worker lets go of its last jobs too)."""
        now = time.monotonic()
        window = self.settings.log_repair_window_s
        while self.finished:
            oldest = next(iter(self.finished))
            if now - self.finished[oldest][0] <= window:
                break
            del self.finished[oldest]

    def drop(self, job_id: str) -> RunningJob | None:
        """A job leaves this worker unfinished (fenced, handed back, drained): stopped in the
        engine, forgotten, and its slot offered to the claim loop."""
        run = self.running.pop(job_id, None)
        if run is not None:
            self.pace.ended(job_id, None)
            self.runner.cancel(job_id, run.attempt, Stop("dropped"))
            self.room.set()
        return run

    def stop(self, run: RunningJob, stop: Stop) -> None:
        """Ask the engine to stop a running job; it ends as `stop` says when the engine
        confirms (once: a second stop of the same job is ignored)."""
        if run.stop is not None or run.end is not None or run.retry_error is not None:
            return
        if run.checking:  # the engine is done with it: its end is being written
            return
        run.stop = stop
        self.runner.cancel(run.id, run.attempt, stop)

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        """Stop a job this worker runs; a cancel that overtook the job's START is kept a while
        (the job is cancelled as it starts)."""
        run = self.running.get(job_id)
        if run is None:
            now = time.monotonic()
            if len(self.early_cancels) > EARLY_CANCELS_KEPT:  # keep the newest, young ones
                young = [
                    kv for kv in self.early_cancels.items() if now - kv[1] < EARLY_CANCEL_TTL_S
                ]
                young.sort(key=lambda kv: kv[1])
                self.early_cancels = dict(young[-EARLY_CANCELS_KEPT // 2 :])
            self.early_cancels[job_id] = now
            return
        self.stop(run, Stop("cancelled", reason))

    def streams(self) -> list[str]:
        """Every stream this worker claims from in its current shard (its lanes, queues and
        overflows): one slot on a cluster, so one XREADGROUP reads them together."""
        return [*self.placed.values(), *self.queues.values(), *self.overflow.values()]

    def all_streams(self) -> list[str]:
        """`streams` of every queue shard (one shard on one Redis: `streams`)."""
        out: list[str] = []
        for shard in range(self.keys.shards):
            for p in self.queues:
                out += [
                    self.keys.placed(self.model, p, self.id, shard),
                    self.keys.queue(self.model, p, shard),
                    self.keys.overflow(self.model, p, shard),
                ]
        return out

    def next_shard(self) -> None:
        """Read the next queue shard from now on (round robin: no shard starves)."""
        if self.keys.shards == 1:
            return
        self.shard = (self.shard + 1) % self.keys.shards
        k, shard = self.keys, self.shard
        for p in list(self.queues):
            self.queues[p] = k.queue(self.model, p, shard)
            self.overflow[p] = k.overflow(self.model, p, shard)
            self.placed[p] = k.placed(self.model, p, self.id, shard)

    def shared_queue(self, stream: str) -> str:
        """Where an entry taken from `stream` goes back to: a worker lane's (this worker's or
        a dead one's) to the model's shared queue of its priority, any other to itself."""
        for priority in self.queues:
            if stream.startswith(self.keys.placed_prefix(self.model, priority)):
                return self.queues[priority]
        return stream

    def in_engine(self) -> int:
        """Running jobs the engine still holds: not those it has ended (or failed) whose end
        is not written yet. Their batch slots are free already, so claims can be STARTed
        while the flush writes those ends, instead of after it."""
        return sum(
            1
            for r in self.running.values()
            if r.end is None and r.retry_error is None and not r.checking
        )

    def ahead_tokens(self) -> int:
        """How near its end (tokens left) a running batch job's slot is claimed ahead."""
        return self.lead.tokens(self.engine.times.recent_s)

    def free_slots(self) -> int:
        if self.engine.down is not None:  # nothing can start until it is back
            return 0
        return self.engine.max_batch - self.in_engine() - len(self.waiting)
