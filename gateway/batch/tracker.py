"""Each gateway's loop that writes a line's result when its job ends.

A batch's job names the batch's done stream in its record; the script that ends the job adds
the job's id to that stream in the same step (shared/lua: EMIT, SETTLE). The gateways read
those streams as one consumer group (at least once): for each ended job, its record and event
log become the line's result (results.py), written once per line (batch_results.lua), then
the entries are acknowledged and deleted and the job's keys kept only
GENQ_BATCH_JOB_RETENTION_S. Entries a dead gateway read but never acknowledged are taken over
after GENQ_BATCH_CLAIM_IDLE_S; what slips past both, the driver's sweep finds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError, ResponseError

from gateway.batch.results import Entries, read_logs, result_of, write_results
from gateway.batch.service import TRACKERS, ensure_group
from gateway.state import GatewayState
from shared.batch_transitions import BatchTransitions, LineResult
from shared.batches import ENDED_BATCH_STATUSES
from shared.events import EventError
from shared.loops import LOOP_RESTART_S
from shared.records import JOB_ID, JobRecord, RecordError
from shared.redis_health import failure_level
from shared.transitions import ScriptRunner

log = logging.getLogger(__name__)

READ_COUNT = 128
"""Entries read per stream and round."""
BLOCK_MS = 1000
"""How long a read waits for entries (new batches join the read after at most this)."""
BUILD_GROUP = 32
"""Results built between two yields to the event loop."""


class BatchTracker:
    def __init__(self, state: GatewayState, wake_driver: Callable[[], None]) -> None:
        self.redis = state.redis
        self.keys = state.keys
        self.settings = state.settings
        self.scripts = ScriptRunner(state.redis)
        self.tx = BatchTransitions(state.keys)
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._wake_driver = wake_driver
        self._took_over_at = 0.0
        self.closing = False

    async def loop(self) -> None:
        # The flag, not only cancellation: a client may turn a cancel into a RedisError.
        while not self.closing:
            try:
                await self.run_once()
            except ResponseError as exc:
                if "UNBLOCKED" in str(exc):  # a batch ended (its stream dropped) during the read
                    continue
                log.warning("batch tracker: read failed; retrying", extra={"error": str(exc)})
                if "NOGROUP" in str(exc):  # Redis lost a stream (restarted without its data)
                    await self._ensure_groups()
                await asyncio.sleep(LOOP_RESTART_S)
            except (RedisError, OSError) as exc:
                log.log(
                    failure_level(self.redis),
                    "batch tracker: Redis failed; retrying",
                    extra={"error": str(exc)},
                )
                await asyncio.sleep(LOOP_RESTART_S)
            except Exception:  # a bug or a damaged record: logged, and the loop goes on
                log.exception("batch tracker failed; going on")
                await asyncio.sleep(LOOP_RESTART_S)

    async def run_once(self) -> None:
        batch_ids = await self.redis.zrange(self.keys.active_batches(), 0, -1)
        if not batch_ids:
            await asyncio.sleep(self.settings.batch_poll_s)
            return
        streams = {self.keys.batch_done(b): b for b in batch_ids}
        reply = await self.redis.xreadgroup(
            TRACKERS, self.consumer, dict.fromkeys(streams, ">"), count=READ_COUNT, block=BLOCK_MS
        )
        for stream, entries in reply or []:
            await self.record(streams[stream], entries)
        if time.monotonic() - self._took_over_at >= self.settings.batch_claim_idle_s / 2:
            self._took_over_at = time.monotonic()
            for stream, batch_id in streams.items():
                await self._take_over(stream, batch_id)

    async def _take_over(self, stream: str, batch_id: str) -> None:
        """Entries another gateway read long ago and never acknowledged: it died."""
        idle_ms = int(self.settings.batch_claim_idle_s * 1000)
        reply: Any = await self.redis.xautoclaim(
            stream, TRACKERS, self.consumer, idle_ms, start_id="0-0", count=READ_COUNT
        )
        entries = [(i, f) for i, f in reply[1] if f]
        if entries:
            log.info("took over job ends", extra={"batch_id": batch_id, "entries": len(entries)})
            await self.record(batch_id, entries)

    async def record(self, batch_id: str, entries: Entries) -> None:
        """The results of the jobs these entries name, then the entries acknowledged."""
        k = self.keys
        jobs = [f.get("job", "") for _, f in entries]
        jobs = [j for j in jobs if JOB_ID.fullmatch(j)]
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(k.batch(batch_id), "status")
        for job_id in jobs:
            pipe.hgetall(k.job(job_id))
        status, *raws = await pipe.execute()
        records = {j: r for j, raw in zip(jobs, raws, strict=True) if (r := _record(j, raw))}
        logs = await read_logs(self.redis, self.keys, records)
        results: list[LineResult] = []
        for i, (job_id, record) in enumerate(records.items()):
            result = _result(job_id, record, logs.get(job_id), status == "cancelling")
            if result is not None:
                results.append(result)
            if i % BUILD_GROUP == BUILD_GROUP - 1:
                await asyncio.sleep(0)  # building responses is CPU work: streams go first
        if results and status not in ENDED_BATCH_STATUSES:
            written = await write_results(self.scripts, self.tx, batch_id, results, self.settings)
            if written.written:
                self._wake_driver()
        await self._acknowledge(batch_id, [i for i, _ in entries], jobs)

    async def _acknowledge(self, batch_id: str, entry_ids: list[str], jobs: list[str]) -> None:
        k = self.keys
        stream = k.batch_done(batch_id)
        keep_s = self.settings.batch_job_retention_s
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(stream, TRACKERS, *entry_ids)
        pipe.xdel(stream, *entry_ids)
        for job_id in jobs:  # its result is the batch's now: its own keys need not stay long
            pipe.expire(k.job(job_id), keep_s, lt=True)
            pipe.expire(k.events(job_id), keep_s, lt=True)
        await pipe.execute()

    async def _ensure_groups(self) -> None:
        for batch_id in await self.redis.zrange(self.keys.active_batches(), 0, -1):
            status = await self.redis.hget(self.keys.batch(batch_id), "status")
            if status is not None and status not in ENDED_BATCH_STATUSES:
                await ensure_group(self.redis, self.keys.batch_done(batch_id))
                await self.redis.expire(self.keys.batch_done(batch_id), self.settings.batch_ttl_s)


def _record(job_id: str, raw: dict[str, str]) -> JobRecord | None:
    if not raw:
        return None  # gone already: the driver's sweep gives the line its error
    try:
        return JobRecord.from_hash(raw)
    except RecordError as exc:
        log.error("unreadable batch job", extra={"job_id": job_id, "error": str(exc)})
        return None


def _result(
    job_id: str, record: JobRecord, log_entries: Entries | None, cancelling: bool
) -> LineResult | None:
    try:
        return result_of(job_id, record, log_entries, batch_cancelling=cancelling)
    except (RecordError, EventError) as exc:
        log.error("unreadable batch job", extra={"job_id": job_id, "error": str(exc)})
        return None
