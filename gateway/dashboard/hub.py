"""One reader of the fleet per gateway process, shared by every dashboard viewer.

The reader runs only while a viewer is connected. Each round it reads the fleet and the
recent jobs and updates the sections (gateway/dashboard/sections.py: each row encoded once,
when it changes). A viewer's stream sends, per round, the rows newer than what it was sent
last (all of them first): a slow viewer skips rounds instead of queueing them, so its
memory is one frame whatever the rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.dashboard.fleet import read_fleet
from gateway.dashboard.recent import RecentJobs
from gateway.dashboard.sections import KEY_OF, Section
from shared.keys import Keys
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)
RETRY_MS = 1000
"""What the stream tells EventSource to wait before it reconnects."""


class DashboardHub:
    def __init__(self, settings: GatewaySettings, redis: aioredis.Redis, keys: Keys) -> None:
        self.settings = settings
        self._redis = redis
        self._keys = keys
        self._recent = RecentJobs(redis, keys, settings.dashboard_jobs, settings.recent_jobs)
        self._sections: dict[str, Section] = {}
        self._round = 0
        self._now = 0.0
        self._error: str | None = None
        """Why the last round failed (Redis away), shown on the page; None when it worked."""
        self._tick = asyncio.Event()
        self._viewers = 0
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def viewers(self) -> int:
        return self._viewers

    async def snapshot(self) -> str:
        """Every section now, as JSON (`GET /dashboard/snapshot`), each a plain list of rows:
        read for this call unless the reader runs for viewers already."""
        if self._task is None or self._task.done():
            await self._read()
        head = self._head()
        parts = "".join(f',"{n}":{s.listing()}' for n, s in self._sections.items())
        return head[:-1] + parts + "}"

    async def stream(self, shutdown: asyncio.Event | None = None) -> AsyncGenerator[str]:
        """One viewer's SSE frames: everything first, then each round's changes. Ends when
        the hub closes or `shutdown` (the server's, for this connection) is set."""
        self._join()
        try:
            yield f"retry: {RETRY_MS}\n\n"
            sent = 0
            while not self._closed:
                if self._round > sent:
                    frame, sent = self._frame(sent), self._round
                    yield f"event: update\ndata: {frame}\n\n"
                elif not await self._next_round(shutdown):
                    return
        finally:
            self._leave()

    async def _next_round(self, shutdown: asyncio.Event | None) -> bool:
        """Wait for the next round; False when the stream should end instead."""
        waits = [asyncio.ensure_future(self._tick.wait())]
        if shutdown is not None:
            waits.append(asyncio.ensure_future(shutdown.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return not self._closed and (shutdown is None or not shutdown.is_set())

    def _frame(self, since: int) -> str:
        """The frame for a viewer sent everything up to round `since` (0: nothing yet), as
        JSON: the sections are spliced in as encoded once, not encoded again per viewer."""
        head = self._head()
        parts = [(name, section.since(since)) for name, section in self._sections.items()]
        return head[:-1] + "".join(f',"{n}":{text}' for n, text in parts if text) + "}"

    def _head(self) -> str:
        head = {
            "now": self._now,
            "round": self._round,
            "interval_s": self.settings.dashboard_interval_s,
            "error": self._error,
        }
        return json.dumps(head, separators=(",", ":"))

    def _join(self) -> None:
        self._viewers += 1
        if self._task is None or self._task.done():
            self._sections.clear()  # read while nobody watched: the first frame waits
            self._task = asyncio.create_task(self._run(), name="dashboard-reader")

    def _leave(self) -> None:
        self._viewers -= 1

    async def _run(self) -> None:
        interval = self.settings.dashboard_interval_s
        while self._viewers > 0 and not self._closed:
            started = time.monotonic()
            await self._read()
            self._publish()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _read(self) -> None:
        async with self._lock:
            await self._read_once()

    async def _read_once(self) -> None:
        s = self.settings
        try:
            fleet = await read_fleet(self._redis, self._keys, s.queue_models, s.dashboard_batches)
            jobs = await self._recent.refresh()
        except (RedisError, OSError) as exc:
            if self._error is None:  # once per outage, not once per round
                log.warning("dashboard cannot read Redis", extra={"error": repr(exc)})
            self._error = f"Redis: {type(exc).__name__}"
            fleet, jobs = {}, None
        else:
            self._error = None
        self._now = time.time()
        self._round += 1
        if jobs is None:
            return
        for name, values in {**fleet, "jobs": jobs}.items():
            section = self._sections.get(name)
            if section is None:
                section = self._sections[name] = Section(KEY_OF[name])
            section.update(values, self._round)

    def _publish(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def close(self) -> None:
        self._closed = True
        self._publish()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
