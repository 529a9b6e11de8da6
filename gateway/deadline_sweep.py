"""Deadlines hold whether or not a worker is up: gateways sweep the deadlines index too, one
at a time (a lock in Redis that lapses by itself), ending queued jobs and those of dead
workers `expired` (shared/deadlines.py).

On a Redis Cluster the same sweep, under the same lock, is the submits' reconciler: a submit
whose process stopped after the job's record was written and before its queue entry (two
slots, two steps: shared/transitions.py) left the entry pending in the job's queue shard;
past `RECONCILE_GRACE_S` the sweep queues it (SUBMIT_QUEUE, exactly once whoever runs it
first). A pending entry whose record never came (the submit stopped before it, and was
never answered 2xx) is given up after `ABANDON_S` (ABANDON_JOB: a submit later still finds
the job abandoned and answers 503)."""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from shared.deadlines import expire_due
from shared.keys import Keys
from shared.loops import one_process_each_round
from shared.settings import GatewaySettings
from shared.transitions import JobState, ScriptRunner, Transitions

log = logging.getLogger(__name__)
SWEEP_LIMIT = 1000
"""Overdue jobs looked at per sweep."""
RECONCILE_GRACE_S = 5.0
"""A pending submit younger than this is left to its gateway (a submit takes milliseconds)."""
ABANDON_S = 60.0
"""A pending submit with no record this old was never answered: its job is marked abandoned
(a submit later still cannot write it) and its entry goes; an Idempotency-Key it claimed is
then free for the client's retry."""
ABANDONED_TTL_S = 3600
"""How long the abandoned mark stays (far past any submit's retries)."""


class DeadlineSweep:
    def __init__(
        self, settings: GatewaySettings, redis: aioredis.Redis, scripts: ScriptRunner, keys: Keys
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.scripts = scripts
        self.keys = keys

    async def run(self) -> None:
        await one_process_each_round(
            self.sweep,
            lock=self.keys.lock("deadline-sweep"),
            failed="deadline sweep failed",
            log=log,
            every_s=self.settings.deadline_sweep_s,
            redis=self.redis,
        )

    async def sweep(self, job_ids: list[str] | None = None) -> list[str]:
        if self.keys.cluster and job_ids is None:
            await self.reconcile()
        expired = await expire_due(
            self.redis, self.scripts, self.keys, self.settings, SWEEP_LIMIT, job_ids
        )
        for job_id in expired:
            log.info("job expired", extra={"job_id": job_id})
        return expired

    async def reconcile(self, now: float | None = None) -> list[str]:
        """Cluster: queue the jobs whose submit stopped between their record and their queue
        entry; their ids (those this sweep queued)."""
        now = time.time() if now is None else now
        transitions = Transitions(self.keys, self.settings.recent_jobs)
        queued: list[str] = []
        for shard in range(self.keys.shards):
            since = self.keys.pending_since(shard)
            old = await self.redis.zrangebyscore(
                since, "-inf", now - RECONCILE_GRACE_S, start=0, num=SWEEP_LIMIT, withscores=True
            )
            if not old:
                continue
            ids = [job_id for job_id, _ in old]
            states = await self.scripts.run_all([transitions.state(j) for j in ids])
            recorded = [
                j
                for j, st in zip(ids, states, strict=True)
                if isinstance(st, JobState) and st.status != "missing"
            ]
            done = await self.scripts.run_all([transitions.reconcile(j) for j in recorded])
            queued += [j for j, ok in zip(recorded, done, strict=True) if ok is True]
            stale = [
                j
                for (j, at), st in zip(old, states, strict=True)
                if isinstance(st, JobState) and st.status == "missing" and at < now - ABANDON_S
            ]
            calls = [transitions.abandon(j, ABANDONED_TTL_S) for j in stale]
            given_up = await self.scripts.run_all(calls)
            came = [j for j, gone in zip(stale, given_up, strict=True) if gone is False]
            done = await self.scripts.run_all([transitions.reconcile(j) for j in came])
            queued += [j for j, ok in zip(came, done, strict=True) if ok is True]
        for job_id in queued:
            log.warning(
                "a submit stopped before queueing its job: queued now", extra={"job_id": job_id}
            )
        return queued
