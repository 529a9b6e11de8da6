"""Finished jobs cost Redis little: GENQ_EVENT_COMPACT_GRACE_S after a job ends, one gateway at a
time (a lock in Redis that lapses by itself) replaces its event log by the compact form in its
record (`shared.compact`) and packs its result.

The jobs wait in the compaction index (a sorted set their end joins, scored by when): a sweep
that dies half-way leaves them there for the next, and COMPACT writes only if the log is still
the one read, so a sweep run twice, or by two processes, compacts a job once."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.compact import CompactLog
from shared.events import EventError
from shared.keys import Keys, seq_of
from shared.records import JobRecord, RecordError, pack
from shared.redis_health import failure_level
from shared.settings import GatewaySettings
from shared.transitions import ScriptRunner, Transitions

log = logging.getLogger(__name__)
SWEEP_LIMIT = 100
"""Jobs compacted per sweep: each reads the job's whole log, so a backlog goes in rounds."""
COMPACTED = "compacted"


class Compactor:
    def __init__(
        self, settings: GatewaySettings, redis: aioredis.Redis, scripts: ScriptRunner, keys: Keys
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.transitions = Transitions(keys, settings.recent_jobs, settings.event_compact_grace_s)
        self._token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    async def run(self) -> None:
        interval = self.settings.event_compact_sweep_s
        while True:
            await asyncio.sleep(interval)
            try:
                if await self._turn(interval):
                    await self.sweep()
            except (RedisError, OSError) as exc:
                level = failure_level(self.redis)
                log.log(level, "compaction sweep failed", extra={"error": str(exc)})

    async def _turn(self, interval: float) -> bool:
        """Whether this process sweeps this round: the lock lasts one interval."""
        lock = self.keys.lock("compact-sweep")
        return bool(await self.redis.set(lock, self._token, nx=True, px=int(interval * 1000)))

    async def sweep(self, now: float | None = None) -> int:
        """Compact up to SWEEP_LIMIT jobs due by `now`; how many were."""
        due = await self.redis.zrangebyscore(
            self.keys.compact_due(), "-inf", time.time() if now is None else now, 0, SWEEP_LIMIT
        )
        done = 0
        for job_id in due:
            done += await self.compact(job_id) == COMPACTED
        return done

    async def compact(self, job_id: str) -> str:
        """Compact one ended job's log: 'compacted', or why not ('changed': next round)."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(k.job(job_id))
        pipe.xrange(k.events(job_id))
        raw, entries = await pipe.execute()
        try:
            record = JobRecord.from_hash(raw) if raw else None
            if record is not None and record.done_stream is not None:
                record = None  # a batch's: its result is the batch's, its keys go soon
            compact = CompactLog.of(entries, record.result) if record is not None else None
        except (RecordError, EventError) as exc:
            log.error("job log not compacted", extra={"job_id": job_id, "error": str(exc)})
            compact = None
        if record is None or compact is None:
            await self.redis.zrem(k.compact_due(), job_id)
            return "skipped"
        result = record.result
        call = self.transitions.compact(
            job_id,
            last_seq=seq_of(entries[-1][0]) if entries else 0,
            entries=len(entries),
            log=compact.encode(),
            result=pack(result.model_dump_json()) if result is not None else "",
        )
        return await self.scripts.run(call)
