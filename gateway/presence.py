"""Which gateway processes are alive, and the jobs that die with them.

A client streaming a job with cancel-on-disconnect (the OpenAI routes' default) cancels it by
going away; when the gateway itself dies, nobody is left to notice, and the job would run on
unread while the client retries it elsewhere. So each gateway process beats in Redis (a
sorted set scored by its last beat) and registers such jobs under its id while it streams
them; every gateway sweeps, one per round (a short lock), cancelling the registered jobs of
gateways silent for their lease plus `orphan_grace_s` — except the jobs a client resumed
through `GET /v1/jobs/{id}/events` (on any gateway), which it marks, and which run on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.identity import GENQ
from gateway.job_service import JobService
from shared.errors import Conflict, JobNotFound
from shared.keys import Keys
from shared.loops import keep_running
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

ORPHAN_REASON = "the gateway streaming it is gone"


def gateway_id() -> str:
    """`<host>-<pid>-<random>`: one per gateway process, never reused."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Presence:
    def __init__(
        self,
        settings: GatewaySettings,
        redis: aioredis.Redis,
        keys: Keys,
        jobs: JobService,
        gateway: str | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.id = gateway or gateway_id()
        self._beating_since: float | None = None
        """Monotonic time of the first beat of the current unbroken run of beats."""

    # ---- what this gateway streams --------------------------------------------------------

    async def register(self, job_ids: Iterable[str]) -> None:
        """These jobs die with this gateway (unless resumed elsewhere)."""
        ids = list(job_ids)
        if ids:
            key = self.keys.gateway_jobs(self.id)
            pipe = self.redis.pipeline(transaction=False)
            pipe.sadd(key, *ids)
            pipe.expire(key, self.settings.retention_s)
            await pipe.execute()

    async def unregister(self, job_ids: Iterable[str]) -> None:
        ids = list(job_ids)
        if ids:
            await self.redis.srem(self.keys.gateway_jobs(self.id), *ids)

    async def mark_resumed(self, job_id: str) -> None:
        """A client reads the job through its events route: no gateway's death cancels it."""
        await self.redis.set(self.keys.resumed(job_id), self.id, ex=self.settings.retention_s)

    # ---- heartbeat and sweep --------------------------------------------------------------

    async def run(self) -> None:
        """Beat and sweep every `gateway_heartbeat_s` until cancelled. Nothing ends the loop:
        a gateway that stopped beating would have its own streams' jobs cancelled."""

        async def step() -> None:
            await self.beat()
            try:
                await self.sweep()
            except Exception:  # the next round tries again
                log.exception("sweeping the jobs of gone gateways failed")

        def beat_failed(exc: Exception) -> None:
            self._beating_since = None

        await keep_running(
            step,
            failed="gateway heartbeat failed",
            log=log,
            every_s=self.settings.gateway_heartbeat_s,
            redis=self.redis,
            pause_first=False,
            on_failure=beat_failed,
        )

    async def beat(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.keys.gateways(), {self.id: time.time()})
        pipe.expire(self.keys.gateway_jobs(self.id), self.settings.retention_s)
        await pipe.execute()
        if self._beating_since is None:
            self._beating_since = time.monotonic()

    async def sweep(self) -> int:
        """Cancel the unresumed jobs of gateways that are gone; the number cancelled.

        Only after beating for a lease: after an outage every gateway's last beat looks old,
        and the others need a lease to beat again before anyone may call them gone.
        """
        s = self.settings
        since = self._beating_since
        if since is None or time.monotonic() - since < s.gateway_lease_s:
            return 0
        cutoff = time.time() - s.gateway_lease_s - s.orphan_grace_s
        gone = await self.redis.zrangebyscore(self.keys.gateways(), "-inf", cutoff)
        if not gone:
            return 0
        lock_ms = max(1, int(s.gateway_heartbeat_s * 1000))
        if not await self.redis.set(self.keys.gateway_sweep(), self.id, nx=True, px=lock_ms):
            return 0  # another gateway sweeps this round
        cancelled = 0
        for gateway in gone:
            cancelled += await self._cancel_orphans(gateway)
            await self.redis.delete(self.keys.gateway_jobs(gateway))
            await self.redis.zrem(self.keys.gateways(), gateway)
        return cancelled

    async def _cancel_orphans(self, gateway: str) -> int:
        cancelled = 0
        key = self.keys.gateway_jobs(gateway)
        async for job_id in self.redis.sscan_iter(key, count=self.settings.event_page_entries):
            if await self.redis.exists(self.keys.resumed(job_id)):
                continue
            with contextlib.suppress(Conflict, JobNotFound):  # ended, or expired, already
                await self.jobs.cancel(job_id, GENQ, ORPHAN_REASON)
                cancelled += 1
        if cancelled:
            log.info(
                "cancelled the jobs of a gateway that is gone",
                extra={"gateway": gateway, "jobs": cancelled},
            )
        return cancelled

    async def close(self) -> None:
        """A gateway that stops cleanly has ended its streams: it leaves nothing to sweep."""
        with contextlib.suppress(RedisError, OSError):
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(self.keys.gateway_jobs(self.id))
            pipe.zrem(self.keys.gateways(), self.id)
            await pipe.execute()
