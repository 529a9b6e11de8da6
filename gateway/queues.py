"""The queues' consumer groups, created by gateways as well as workers.

Workers create the groups of their own model's queues when they start. A queue autoscaler
(KEDA's redis-streams scaler) reads the group's lag and pending count, and a missing group is
an error to it: with workers scaled to zero nobody would create one. So every gateway process
creates the groups too: at start for the configured models (`queue_models`) and every model
a worker ever announced (the models set), and again every `RESYNC_S`, which also restores
groups that a Redis restarted without its data lost.

`XGROUP CREATE … 0 MKSTREAM` is idempotent here (BUSYGROUP: it exists) and starts at the
stream's beginning, as the workers' own does, so jobs queued before the group are not skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys

log = logging.getLogger(__name__)

RESYNC_S = 30.0
"""How often a gateway process re-reads the models set and (re)creates groups."""
RETRY_S = 1.0
"""After a failed round (Redis away), the next one comes this soon."""
START_TIMEOUT_S = 5.0
"""The first round holds the gateway's start at most this long: with Redis away, the gateway
must still come up (and answer /healthz) rather than wait out every client retry."""
_EXISTS = "BUSYGROUP"


class QueueGroups:
    def __init__(self, redis: aioredis.Redis, keys: Keys, configured: list[str]) -> None:
        self._redis = redis
        self._keys = keys
        self._configured = list(configured)

    async def models(self) -> list[str]:
        """The configured models and every model a worker announced."""
        announced: set[str] = await self._redis.smembers(self._keys.models())
        return sorted(set(self._configured) | announced)

    async def ensure(self, models: list[str]) -> None:
        """Create the group of each model's streams (both priorities, queue and overflow)
        where it is missing."""
        if not models:
            return
        pipe = self._redis.pipeline(transaction=False)
        queues = [lane for m in models for p in PRIORITIES for lane in self._keys.all_lanes(m, p)]
        for queue in queues:
            pipe.xgroup_create(queue, CONSUMER_GROUP, id="0", mkstream=True)
        for queue, reply in zip(queues, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, ResponseError):
                if not str(reply).startswith(_EXISTS):  # e.g. WRONGTYPE: not ours to fix
                    log.warning("no consumer group", extra={"queue": queue, "error": str(reply)})
            elif isinstance(reply, Exception):
                raise reply

    async def sync(self) -> None:
        await self.ensure(await self.models())

    async def sync_logged(self, timeout_s: float | None = None) -> bool:
        """`sync`, with a Redis failure logged rather than raised (the next round retries)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.sync()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("consumer groups not synced; retrying", extra={"error": repr(exc)})
            return False
        return True

    async def run(self, synced: bool) -> None:
        while True:
            await asyncio.sleep(RESYNC_S if synced else RETRY_S)
            synced = await self.sync_logged()


async def start(redis: aioredis.Redis, keys: Keys, configured: list[str]) -> asyncio.Task[None]:
    """Sync the groups once now, then keep them in sync in a task; the caller cancels it
    (`stop`) at shutdown."""
    groups = QueueGroups(redis, keys, configured)
    synced = await groups.sync_logged(START_TIMEOUT_S)
    return asyncio.create_task(groups.run(synced), name="queue-groups")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
