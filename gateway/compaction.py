"""Finished jobs cost Redis little: GENQ_EVENT_COMPACT_GRACE_S after a job ends, one gateway at a
time (a lock in Redis that lapses by itself) replaces its event log by the compact form in its
record (`shared.compact`) and packs its result.

The jobs wait in the compaction index (a sorted set their end joins, scored by when): a sweep
that dies half-way leaves them there for the next, and COMPACT writes only if the log is still
the one read, so a sweep run twice, or by two processes, compacts a job once."""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from shared.compact import CompactLog, LogEntries
from shared.events import EventError
from shared.keys import Keys, seq_of
from shared.loops import one_process_each_round
from shared.records import PACKED, JobRecord, RecordError, pack
from shared.settings import GatewaySettings
from shared.transitions import Call, ScriptRunner, Transitions

log = logging.getLogger(__name__)
SWEEP_LIMIT = 100
"""Jobs read and compacted per pipeline: each reads the job's whole log."""
COMPACTED = "compacted"
PACKED_FIELDS = ("result", "spec")
"""Record fields an ended job keeps for its retention and reads seldom: its result (text,
token ids) and spec (prompt ids, sampler settings: its prompt may be long)."""


class Compactor:
    def __init__(
        self, settings: GatewaySettings, redis: aioredis.Redis, scripts: ScriptRunner, keys: Keys
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.transitions = Transitions(keys, settings.recent_jobs, settings.event_compact_grace_s)

    async def run(self) -> None:
        await one_process_each_round(
            self.sweep,
            lock=self.keys.lock("compact-sweep"),
            failed="compaction sweep failed",
            log=log,
            every_s=self.settings.event_compact_sweep_s,
            redis=self.redis,
        )

    async def sweep(self, now: float | None = None) -> int:
        """Compact the jobs due by `now`, SWEEP_LIMIT at a time for at most one interval (a
        backlog goes on next round); how many were compacted."""
        now = time.time() if now is None else now
        started = time.monotonic()
        done = 0
        while True:
            due: list[str] = []
            full = False
            for shard in range(self.keys.shards):  # one on one Redis
                page = await self.redis.zrangebyscore(
                    self.keys.compact_due(shard), "-inf", now, 0, SWEEP_LIMIT
                )
                due += page
                full = full or len(page) >= SWEEP_LIMIT
            replies = await self.compact_many(due)
            done += replies.count(COMPACTED)
            spent = time.monotonic() - started
            if not full or spent >= self.settings.event_compact_sweep_s:
                return done

    async def compact(self, job_id: str) -> str:
        """Compact one ended job's log: 'compacted', or why not ('changed': next round)."""
        return (await self.compact_many([job_id]))[0]

    async def compact_many(self, job_ids: list[str]) -> list[str]:
        """Compact these jobs' logs: one pipeline reads them, one writes; each one's outcome
        ('compacted', 'skipped', or 'changed': its log changed since, next round)."""
        if not job_ids:
            return []
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(k.job(job_id))
            pipe.xrange(k.events(job_id))
        read = await pipe.execute()
        calls = {}
        for i, job_id in enumerate(job_ids):
            call = self._call(job_id, read[2 * i], read[2 * i + 1])
            if call is not None:
                calls[job_id] = call
        skipped = [j for j in job_ids if j not in calls]
        if skipped:
            await self.redis.zrem(k.compact_due(), *skipped)
        replies = dict(zip(calls, await self.scripts.run_all(list(calls.values())), strict=True))
        return [_outcome(replies.get(j, "skipped")) for j in job_ids]

    def _call(self, job_id: str, raw: dict[str, str], entries: LogEntries) -> Call[str] | None:
        """The COMPACT call of one job, as read; None for a job not to compact (gone, a
        batch's, or one whose record or log does not decode)."""
        try:
            record = JobRecord.from_hash(raw) if raw else None
            if record is None or record.done_stream is not None:
                return None  # gone, or a batch's: its result is the batch's, its keys go soon
            compact = CompactLog.of(entries, record.result)
        except (RecordError, EventError) as exc:
            log.error("job log not compacted", extra={"job_id": job_id, "error": str(exc)})
            return None
        fields = {"log": compact.encode()}
        for name in PACKED_FIELDS:  # kept whole, read rarely: packed where that is smaller
            value = raw.get(name)
            if value is not None and not value.startswith(PACKED):
                if len(packed := pack(value)) < len(value):
                    fields[name] = packed
        return self.transitions.compact(
            job_id,
            last_seq=seq_of(entries[-1][0]) if entries else 0,
            entries=len(entries),
            fields=fields,
        )


def _outcome(reply: str | Exception) -> str:
    if isinstance(reply, Exception):  # Redis refused it (full, restarting): next round
        log.warning("job log not compacted", extra={"error": str(reply)})
        return "changed"
    return reply
