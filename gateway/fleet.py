"""The fleet's gauges, read from Redis and exported by one gateway process at a time.

Queue depth, lag and pending per model and priority, dead letters, each worker's heartbeat
age and the batches by status are the same whichever gateway reads them; exported by every
replica they would be counted once per replica by any `sum()`. So the gateway processes
share a lease in Redis (`Keys.fleet_metrics_lease`, SET NX PX through shared/lua/lease.lua,
renewed every `metrics_fleet_interval_s`): its holder reads the fleet each round and
exports it, the others export none of it. A holder that stops frees the lease; one that dies
loses it after `metrics_fleet_lease_s`, and the next process to try takes it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import get_args

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from shared.batches import ENDED_BATCH_STATUSES, BatchStatus
from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys, Priority
from shared.loops import honour_cancel
from shared.settings import GatewaySettings
from shared.transitions import Call, ScriptRunner, lease

log = logging.getLogger(__name__)

OPEN_BATCH_STATUSES = tuple(s for s in get_args(BatchStatus) if s not in ENDED_BATCH_STATUSES)
"""Each shown, at 0 when no batch has it: a series that appears only once non-zero is hard
to alert on."""

QueueStats = dict[tuple[str, Priority], tuple[int, int, int]]
"""(model, priority) → (length, lag, pending), queue and overflow lanes together."""


@dataclass(slots=True)
class WorkerBeat:
    worker: str
    model: str
    gpu: str
    age_s: float


@dataclass(slots=True)
class FleetReading:
    at: float
    queues: QueueStats = field(default_factory=dict)
    dead_letters: int = 0
    webhook_backlog: int = 0
    webhook_dead_letters: int = 0
    workers: list[WorkerBeat] = field(default_factory=list)
    batches: dict[str, int] = field(default_factory=dict)
    """Batches not yet ended, by status."""


async def _webhook_backlog(redis: aioredis.Redis, keys: Keys) -> tuple[int, int]:
    """Recorded deliveries (waiting to be retried), and outbox entries not yet acked (their
    first attempts not yet made, or in flight): an acked entry is deleted."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zcard(keys.webhook_due())
        pipe.xlen(keys.webhook_outbox())
        due, outbox = await pipe.execute()
    return int(due), int(outbox)


async def read_fleet(redis: aioredis.Redis, keys: Keys, models: Iterable[str]) -> FleetReading:
    reading = FleetReading(at=time.time())
    reading.queues = await _queues(redis, keys, sorted(set(models)))
    reading.dead_letters = int(await redis.xlen(keys.dead_letters()))
    due, outbox = await _webhook_backlog(redis, keys)
    reading.webhook_backlog = due + outbox
    reading.webhook_dead_letters = int(await redis.xlen(keys.webhook_dead()))
    reading.workers = await _workers(redis, keys, reading.at)
    reading.batches = await _batches(redis, keys)
    return reading


async def _queues(redis: aioredis.Redis, keys: Keys, models: list[str]) -> QueueStats:
    lanes = [(m, p, lane) for m in models for p in PRIORITIES for lane in keys.all_lanes(m, p)]
    pipe = redis.pipeline(transaction=False)
    for _, _, lane in lanes:
        pipe.xlen(lane)
        pipe.xinfo_groups(lane)
    replies = await pipe.execute(raise_on_error=False)
    stats: QueueStats = {}
    for i, (model, priority, _) in enumerate(lanes):
        length, groups = replies[2 * i], replies[2 * i + 1]
        length = length if isinstance(length, int) else 0  # no stream yet: an error here
        groups = groups if isinstance(groups, list) else []
        group = next((g for g in groups if g.get("name") == CONSUMER_GROUP), None)
        pending = int(group.get("pending") or 0) if group else 0
        lag = group.get("lag") if group else None
        # Redis cannot always tell the lag (entries deleted past the group's position): genq
        # deletes what it acknowledges, so what is neither delivered nor pending is the rest.
        lag = int(lag) if lag is not None else max(0, length - pending)
        before = stats.get((model, priority), (0, 0, 0))
        stats[(model, priority)] = (before[0] + length, before[1] + lag, before[2] + pending)
    # token-fair scheduling's waiting jobs are queued too, not yet let into the stream
    fair = [(m, p) for m in models for p in PRIORITIES for _ in range(keys.shards)]
    sets = [keys.fair_queue(m, p, i % keys.shards) for i, (m, p) in enumerate(fair)]
    for (model, priority), n in zip(fair, await _pipelined(redis, sets), strict=True):
        length, lag, pending = stats.get((model, priority), (0, 0, 0))
        stats[(model, priority)] = (length + n, lag + n, pending)
    return stats


async def _pipelined(redis: aioredis.Redis, sets: list[str]) -> list[int]:
    pipe = redis.pipeline(transaction=False)
    for key in sets:
        pipe.zcard(key)
    return [int(n) if isinstance(n, int) else 0 for n in await pipe.execute(raise_on_error=False)]


async def _workers(redis: aioredis.Redis, keys: Keys, now: float) -> list[WorkerBeat]:
    """Every worker of the workers set whose heartbeat is still there: its last beat's age
    (a worker whose age nears its lease is stalled, or cut off from Redis)."""
    ids: list[str] = await redis.zrange(keys.workers(), 0, -1)
    if not ids:
        return []
    pipe = redis.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hmget(keys.worker(worker_id), ["model", "gpu", "beat_at"])
    replies = await pipe.execute()
    beats = []
    for worker_id, (model, gpu, beat) in zip(ids, replies, strict=True):
        if model is None or not beat:
            continue  # gone, or of a version that does not write its beat time
        with contextlib.suppress(ValueError):
            beats.append(WorkerBeat(worker_id, model, gpu or "", max(0.0, now - float(beat))))
    return beats


async def _batches(redis: aioredis.Redis, keys: Keys) -> dict[str, int]:
    ids: list[str] = await redis.zrange(keys.active_batches(), 0, -1)
    if not ids:
        return {}
    pipe = redis.pipeline(transaction=False)
    for batch_id in ids:
        pipe.hget(keys.batch(batch_id), "status")
    return dict(Counter(s for s in await pipe.execute() if s is not None))


def families(reading: FleetReading) -> Iterator[Metric]:
    """The reading as metric families (gauges: each is the fleet's state now)."""
    mp = ["model", "priority"]
    length = GaugeMetricFamily(
        "genq_queue_length", "Jobs in the queue streams: waiting and claimed.", labels=mp
    )
    lag = GaugeMetricFamily(
        "genq_queue_lag", "Jobs waiting for a worker (not claimed yet).", labels=mp
    )
    pending = GaugeMetricFamily(
        "genq_queue_pending", "Jobs claimed by a worker and not finished.", labels=mp
    )
    for (model, priority), (n, waiting, claimed) in sorted(reading.queues.items()):
        length.add_metric([model, priority], n)
        lag.add_metric([model, priority], waiting)
        pending.add_metric([model, priority], claimed)
    yield from (length, lag, pending)
    yield GaugeMetricFamily(
        "genq_dead_letters",
        "Entries in the dead-letter stream (jobs out of attempts, malformed entries).",
        value=reading.dead_letters,
    )
    yield GaugeMetricFamily(
        "genq_webhook_backlog",
        "Webhook events not yet delivered: ends in the outbox not yet sent (or in flight), "
        "and deliveries waiting to be retried.",
        value=reading.webhook_backlog,
    )
    yield GaugeMetricFamily(
        "genq_webhook_dead_letters",
        "Webhook deliveries given up on (out of retries, or their endpoint disabled by 410).",
        value=reading.webhook_dead_letters,
    )
    age = GaugeMetricFamily(
        "genq_worker_heartbeat_age_seconds",
        "Seconds since each worker's last heartbeat reached Redis.",
        labels=["model", "worker", "gpu"],
    )
    for beat in sorted(reading.workers, key=lambda b: b.worker):
        age.add_metric([beat.model, beat.worker, beat.gpu], round(beat.age_s, 3))
    yield age
    batches = GaugeMetricFamily(
        "genq_batches", "Batches not yet ended, by status.", labels=["status"]
    )
    for status in sorted(set(OPEN_BATCH_STATUSES) | set(reading.batches)):
        batches.add_metric([status], reading.batches.get(status, 0))
    yield batches
    yield GaugeMetricFamily(
        "genq_fleet_read_timestamp_seconds",
        "When the exporting gateway last read the fleet's gauges from Redis (unix time).",
        value=reading.at,
    )


class _Reading:
    def __init__(self, reading: FleetReading) -> None:
        self.reading = reading

    def collect(self) -> Iterator[Metric]:
        return families(self.reading)


def render(reading: FleetReading) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Reading(reading))
    return generate_latest(registry)


class FleetExporter:
    """Holds or waits for the fleet lease; while holding it, keeps `metrics`' fleet text
    fresh."""

    def __init__(
        self,
        settings: GatewaySettings,
        redis: aioredis.Redis,
        keys: Keys,
        token: str,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = keys
        self.token = token
        """Who holds the lease: this gateway process's presence id."""
        self.metrics = metrics
        self.scripts = ScriptRunner(redis)
        self.holding = False

    def _lease(self, action: str, ttl_ms: int = 0) -> Call[bool]:
        return lease(self.keys.fleet_metrics_lease(), self.token, action, ttl_ms)

    async def run(self) -> None:
        while True:
            await self.round()
            honour_cancel()
            await asyncio.sleep(self.settings.metrics_fleet_interval_s)

    async def round(self) -> None:
        """Take or renew the lease; holding it, read and publish the fleet's gauges."""
        self.metrics.sample_process()  # every process, each round: its siblings render it
        ttl_ms = int(self.settings.metrics_fleet_lease_s * 1000)
        body = b""
        try:
            held = await self.scripts.run(self._lease("hold", ttl_ms))
            if held:
                models = await self._models()
                body = render(await read_fleet(self.redis, self.keys, models))
        except (RedisError, OSError) as exc:
            log.warning("fleet metrics not read", extra={"error": str(exc)})
            held = False  # a lease that cannot be renewed is as good as lost
        if held != self.holding:
            log.info("fleet metrics " + ("exported here" if held else "no longer exported here"))
        if held or self.holding:  # never clear what a sibling holding the lease wrote
            self.metrics.set_fleet(body)
        self.holding = held

    async def _models(self) -> list[str]:
        announced: set[str] = await self.redis.smembers(self.keys.models())
        return sorted(set(self.settings.queue_models) | announced)

    async def close(self) -> None:
        """Stop exporting and free the lease, so that another process takes it at once."""
        if self.holding:
            self.metrics.set_fleet(b"")
            self.holding = False
            with contextlib.suppress(RedisError, OSError):
                await self.scripts.run(self._lease("free"))
