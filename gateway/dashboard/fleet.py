"""The fleet as the dashboard shows it, read from Redis in two pipelined round trips:
models (their cards), queues (length, lag and pending of each model's priorities), workers
(their heartbeats) and recent batches. Plain JSON-ready dicts; no owner, no prompt."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError

from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys
from shared.records import Heartbeat, RecordError
from shared.schemas import ModelCard

log = logging.getLogger(__name__)
Row = dict[str, Any]
BATCH_FIELDS = ("id", "status", "endpoint", "model", "total", "completed", "failed")
BATCH_TIMES = ("created_at", "expires_at", "completed_at")


async def read_fleet(
    redis: aioredis.Redis, keys: Keys, configured: list[str], batches: int
) -> dict[str, list[Row]]:
    """Every section but the recent jobs: {"models", "queues", "workers", "batches"}."""
    pipe = redis.pipeline(transaction=False)
    pipe.smembers(keys.models())
    pipe.zrangebyscore(keys.workers(), time.time(), "+inf")
    pipe.zrevrange(keys.batches(), 0, batches - 1)
    announced, worker_ids, batch_ids = await pipe.execute()
    models = sorted(set(configured) | set(announced))
    lanes = [(m, p, lane) for m in models for p in PRIORITIES for lane in keys.lanes(m, p)]
    pipe = redis.pipeline(transaction=False)
    for m in models:
        pipe.hget(keys.model_card(m), "card")
    for *_, lane in lanes:
        pipe.xlen(lane)
        pipe.xinfo_groups(lane)
    for w in worker_ids:
        pipe.hgetall(keys.worker(w))
    for b in batch_ids if batches else []:
        pipe.hmget(keys.batch(b), *BATCH_FIELDS, *BATCH_TIMES)
    replies = list(await pipe.execute(raise_on_error=False))
    cards, replies = replies[: len(models)], replies[len(models) :]
    queue_replies, replies = replies[: 2 * len(lanes)], replies[2 * len(lanes) :]
    beats, batch_rows = replies[: len(worker_ids)], replies[len(worker_ids) :]
    workers = _workers(beats)
    return {
        "models": _models(models, cards, workers),
        "queues": _queues(lanes, queue_replies),
        "workers": workers,
        "batches": [_batch(r) for r in batch_rows if isinstance(r, list) and r[0]],
    }


def _models(names: list[str], cards: list[Any], workers: list[Row]) -> list[Row]:
    out = []
    for name, raw in zip(names, cards, strict=True):
        row: Row = {"name": name, "workers": sum(1 for w in workers if w["model"] == name)}
        if isinstance(raw, str):
            try:
                card = ModelCard.model_validate_json(raw)
            except ValidationError:
                card = None
            if card is not None:
                row |= {
                    "engine": card.engine,
                    "simulated": card.simulated,
                    "max_seq_len": card.max_seq_len,
                    "max_batch": card.max_batch,
                }
        out.append(row)
    return out


def _group(reply: Any) -> tuple[int | None, int]:
    """(lag, pending) of the workers' group in an XINFO GROUPS reply; lag None when Redis
    cannot tell (entries deleted in the range it would count), or the stream is missing."""
    if not isinstance(reply, list):
        return None, 0
    for g in reply:
        if g.get("name") == CONSUMER_GROUP:
            lag = g.get("lag")
            return (int(lag) if lag is not None else None), int(g.get("pending", 0))
    return None, 0


def _queues(lanes: Sequence[tuple[str, str, str]], replies: list[Any]) -> list[Row]:
    """One row per model and priority: its queue and overflow streams added together."""
    rows: dict[tuple[str, str], Row] = {}
    for i, (model, priority, _lane) in enumerate(lanes):
        length = replies[2 * i] if isinstance(replies[2 * i], int) else 0
        lag, pending = _group(replies[2 * i + 1])
        row = rows.setdefault(
            (model, priority),
            {"model": model, "priority": priority, "length": 0, "lag": 0, "pending": 0},
        )
        row["length"] += length
        row["pending"] += pending
        # Unknown lag: what is not pending is waiting (entries are deleted once acknowledged).
        row["lag"] += lag if lag is not None else max(0, length - pending)
    return list(rows.values())


def _workers(replies: list[Any]) -> list[Row]:
    out = []
    for raw in replies:
        if not isinstance(raw, dict) or not raw:
            continue  # its lease is in the set, its heartbeat gone: it died this moment
        try:
            hb = Heartbeat.from_hash(raw)
        except RecordError:
            continue  # a worker of another version: /readyz and the logs say so
        out.append(
            {
                "id": hb.worker_id,
                "model": hb.model,
                "engine": hb.engine,
                "gpu": hb.gpu,
                "host": hb.host,
                "active": hb.active,
                "capacity": hb.capacity,
                "waiting": hb.waiting,
                "kv_used": hb.kv_pages_used,
                "kv_total": hb.kv_pages_total,
                "tokens_per_s": hb.tokens_per_s,
                "beat_at": hb.beat_at or None,
                "started_at": hb.started_at,
                "draining": hb.draining,
                "engine_down": hb.engine_down,
                "engine_restarts": hb.engine_restarts,
            }
        )
    return sorted(out, key=lambda w: (w["model"], w["id"]))


def _batch(values: list[Any]) -> Row:
    row: Row = dict(zip((*BATCH_FIELDS, *BATCH_TIMES), values, strict=True))
    for name in ("total", "completed", "failed"):
        row[name] = int(row[name] or 0)
    for name in BATCH_TIMES:
        row[name] = float(row[name]) if row[name] else None
    return row
