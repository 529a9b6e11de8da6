"""Deadlines hold whether or not a worker is up: gateways sweep the deadlines index too, one
at a time (a lock in Redis that lapses by itself), ending queued jobs and those of dead
workers `expired` (shared/deadlines.py)."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from shared.deadlines import expire_due
from shared.keys import Keys
from shared.loops import one_process_each_round
from shared.settings import GatewaySettings
from shared.transitions import ScriptRunner

log = logging.getLogger(__name__)
SWEEP_LIMIT = 1000
"""Overdue jobs looked at per sweep."""


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
        expired = await expire_due(
            self.redis, self.scripts, self.keys, self.settings, SWEEP_LIMIT, job_ids
        )
        for job_id in expired:
            log.info("job expired", extra={"job_id": job_id})
        return expired
