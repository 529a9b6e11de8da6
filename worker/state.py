"""What the worker's phases share: who it is, where it writes, the jobs it holds, and the
events by which one phase wakes another. Plain state, no Redis calls."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shared.keys import Keys, Priority
from shared.settings import WorkerSettings
from shared.transitions import ScriptRunner, Transitions
from worker.engine import Engine
from worker.jobstate import Claim, RunningJob
from worker.lease import LeaseClock
from worker.runner import EngineRunner

LOOP_RESTART_S = 0.5
EARLY_CANCELS_KEPT = 1000
EARLY_CANCEL_TTL_S = 60.0


@dataclass(slots=True, eq=False)
class WorkerState:
    settings: WorkerSettings
    engine: Engine
    id: str
    model: str
    keys: Keys
    redis: aioredis.Redis
    scripts: ScriptRunner
    transitions: Transitions
    queues: dict[Priority, str]
    lease: LeaseClock
    running: dict[str, RunningJob] = field(default_factory=dict)
    waiting: list[Claim] = field(default_factory=list)
    """Claimed, not STARTed yet (the engine had no room, or START has not run)."""
    dirty: set[str] = field(default_factory=set)
    urgent: set[str] = field(default_factory=set)
    """Dirty jobs whose events should not wait for the flush interval."""
    early_cancels: dict[str, float] = field(default_factory=dict)
    cancel_reason: dict[str, str] = field(default_factory=dict)
    expiring: set[str] = field(default_factory=set)
    flush_wanted: asyncio.Event = field(default_factory=asyncio.Event)
    room: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False
    runner: EngineRunner | None = None
    healthy: bool = True

    def forget(self, job_id: str) -> RunningJob | None:
        """A job leaves this worker: drop it and every note kept about it."""
        self.cancel_reason.pop(job_id, None)
        self.expiring.discard(job_id)
        return self.running.pop(job_id, None)

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        """Stop a job this worker runs; a cancel that overtook the job's START is kept a while
        (the job is cancelled as it starts)."""
        if job_id not in self.running:
            now = time.monotonic()
            if len(self.early_cancels) > EARLY_CANCELS_KEPT:  # keep the newest, young ones
                young = [
                    kv for kv in self.early_cancels.items() if now - kv[1] < EARLY_CANCEL_TTL_S
                ]
                young.sort(key=lambda kv: kv[1])
                self.early_cancels = dict(young[-EARLY_CANCELS_KEPT // 2 :])
            self.early_cancels[job_id] = now
            return
        self.cancel_reason[job_id] = reason
        assert self.runner is not None
        self.runner.cancel(job_id)

    def free_slots(self) -> int:
        return self.engine.max_batch - len(self.running) - len(self.waiting)
