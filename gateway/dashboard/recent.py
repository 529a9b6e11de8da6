"""The recent jobs the dashboard lists: learnt from the recent-jobs stream (an entry per job
submitted and per job ended, `shared.records.RecentJob`), completed from the job records.

Only new stream entries are read each round (the last id read is kept). A job's record is
read while it is not ended, and once more when it ends; an ended job costs nothing after.
Shown: ids, model, priority, status, attempt, worker, token counts and timings — never the
prompt, the text or the owner.

A running job has no usage in its record until it ends: its tokens so far are counted from
its event log, only the entries new since the last round (`LOG_PAGE` at most a round, so a
fast job catches up over a few rounds rather than costing one round a long read)."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shared import events
from shared.events import EVENT_FIELD, EventError, QueuedEvent, StartedEvent, TokenEvent
from shared.keys import Keys, event_id, seq_of
from shared.records import RecentJob, RecordError

ENDED = frozenset({"succeeded", "failed", "cancelled", "expired"})
RECORD_FIELDS = ("status", "attempt", "worker", "started_at", "finished_at", "usage", "timings")
LOG_PAGE = 256
"""Most event-log entries read per running job and round."""


@dataclass(slots=True)
class JobRow:
    id: str
    model: str | None
    priority: str | None
    created_at: float
    status: str = "queued"
    settled: bool = False
    """Ended, and its record read since: nothing about it changes any more."""
    detail: dict[str, Any] = field(default_factory=dict)
    log_seq: int = 0
    """The last event-log entry counted (running jobs: tokens so far)."""
    prompt_tokens: int | None = None
    tokens_so_far: int | None = None
    """Tokens generated so far, from the log: the tokens an attempt resumed with, then those
    of its token events."""

    def view(self) -> dict[str, Any]:
        out = {
            "id": self.id,
            "model": self.model,
            "priority": self.priority,
            "status": self.status,
            "created_at": self.created_at,
            **self.detail,
        }
        if self.status == "running" and out.get("completion_tokens") is None:
            out["tokens_so_far"] = self.tokens_so_far or 0
            if out.get("prompt_tokens") is None:
                out["prompt_tokens"] = self.prompt_tokens
        return out

    def count(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        """Fold new event-log entries into the tokens so far."""
        for entry_id, fields in entries:
            self.log_seq = seq_of(entry_id)
            try:
                ev = events.decode(fields[EVENT_FIELD])
            except (EventError, KeyError):  # a damaged entry: the rest still counts
                continue
            if isinstance(ev, TokenEvent):
                self.tokens_so_far = (self.tokens_so_far or 0) + ev.count
            elif isinstance(ev, StartedEvent):
                self.tokens_so_far = ev.resumed_tokens
            elif isinstance(ev, QueuedEvent):
                self.prompt_tokens = ev.prompt_tokens


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _entry_time(entry_id: str) -> float:
    return int(entry_id.partition("-")[0]) / 1000


class RecentJobs:
    def __init__(self, redis: aioredis.Redis, keys: Keys, shown: int, read_max: int) -> None:
        self._redis = redis
        self._streams = [keys.recent_jobs(shard) for shard in range(keys.shards)]
        """One on one Redis; on a cluster, each queue shard's (merged by entry time)."""
        self._keys = keys
        self._shown = shown
        self._read_max = max(read_max, shown)
        """Most stream entries read per round (the stream's cap: more are trimmed anyway)."""
        self._last: dict[str, str] = {}
        self._rows: OrderedDict[str, JobRow] = OrderedDict()
        """Newest submission first."""

    async def refresh(self) -> list[dict[str, Any]]:
        await self._read_stream()
        await self._read_records()
        await self._read_progress()
        return [row.view() for row in self._rows.values()]

    async def _read_progress(self) -> None:
        running = [r for r in self._rows.values() if r.status == "running"]
        if not running:
            return
        pipe = self._redis.pipeline(transaction=False)
        for row in running:
            after = f"({event_id(row.log_seq)}" if row.log_seq else "-"
            pipe.xrange(self._keys.events(row.id), after, "+", count=LOG_PAGE)
        for row, entries in zip(running, await pipe.execute(), strict=True):
            row.count(entries)

    async def _read_stream(self) -> None:
        entries: list[tuple[str, dict[str, str]]] = []
        for key in self._streams:
            last = self._last.get(key)
            low = "-" if last is None else f"({last}"
            page = await self._redis.xrevrange(key, "+", low, count=self._read_max)
            if page:
                self._last[key] = page[0][0]
                entries += page
        if not entries:
            return
        entries.sort(key=lambda e: _entry_order(e[0]))
        for entry_id, fields in entries:
            try:
                entry = RecentJob.from_hash(fields)
            except RecordError:
                continue
            self._apply(entry_id, entry)
        while len(self._rows) > self._shown:
            self._rows.popitem(last=True)

    def _apply(self, entry_id: str, entry: RecentJob) -> None:
        row = self._rows.get(entry.job)
        if row is None:
            if entry.status != "queued":
                return  # the end of a job submitted before what this gateway read
            row = JobRow(entry.job, entry.model, entry.priority, _entry_time(entry_id))
            self._rows[entry.job] = row
            self._rows.move_to_end(entry.job, last=False)
        elif entry.status in ENDED and not row.settled:
            row.status = entry.status

    async def _read_records(self) -> None:
        open_rows = [r for r in self._rows.values() if not r.settled]
        if not open_rows:
            return
        pipe = self._redis.pipeline(transaction=False)
        for row in open_rows:
            pipe.hmget(self._keys.job(row.id), *RECORD_FIELDS)
        for row, values in zip(open_rows, await pipe.execute(), strict=True):
            _fill(row, dict(zip(RECORD_FIELDS, values, strict=True)))


def _json(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _fill(row: JobRow, record: dict[str, str | None]) -> None:
    status = record["status"]
    if status is None:  # gone: expired with its retention, or never written
        row.settled = True
        return
    row.status = status
    usage, timings = _json(record["usage"]), _json(record["timings"])
    row.detail = {
        "attempt": int(_number(record["attempt"]) or 0),
        "worker": record["worker"],
        "started_at": _number(record["started_at"]),
        "finished_at": _number(record["finished_at"]),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "queue_s": timings.get("queue_s"),
        "ttft_s": timings.get("ttft_s"),
        "generation_s": timings.get("generation_s"),
    }
    row.settled = status in ENDED
