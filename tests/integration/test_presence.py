"""Gateway presence: a gone gateway's registered jobs are cancelled by a sweep, except those a
client resumed; a gateway that has just (re)gained Redis does not sweep until it has beaten
for a lease. On real Redis and on fakeredis, with an in-process sim worker."""

from __future__ import annotations

import asyncio
import time

from gateway.job_service import JobService
from gateway.presence import ORPHAN_REASON, Presence
from gateway.registry import ModelRegistry
from shared.keys import Keys
from shared.settings import Settings
from shared.transitions import ScriptRunner
from tests.conftest import parse_sse, running_stack

LEASE_S = 0.3
LONG_AGO_S = 100.0
SWEPT_WITHIN_S = 5.0


async def test_a_gone_gateways_jobs_are_cancelled_unless_resumed_and_not_before_a_lease(
    settings: Settings, redis
) -> None:  # type: ignore[no-untyped-def]
    settings.gateway_lease_s = LEASE_S
    settings.gateway_heartbeat_s = LEASE_S / 3
    settings.orphan_grace_s = 0.0
    async with running_stack(settings, redis, step_ms=20) as stack:
        orphan = (await stack.submit(prompt="orphan", max_tokens=5000))["id"]
        kept = (await stack.submit(prompt="kept", max_tokens=5000))["id"]
        await stack.wait_status(orphan, "running")
        # Presence keys of their own: the app's own sweeper must not see the gone gateway.
        keys = Keys(settings.key_prefix + "presence:")
        registry = ModelRegistry(redis, Keys(settings.key_prefix), settings.card_cache_s)
        jobs = JobService(settings, redis, ScriptRunner(redis), registry)
        gone = Presence(settings, redis, keys, jobs, gateway="gone")
        await gone.beat()
        await gone.register([orphan, kept])
        await gone.mark_resumed(kept)
        await redis.zadd(keys.gateways(), {"gone": time.time() - LONG_AGO_S})
        sweeper = Presence(settings, redis, keys, jobs, gateway="sweeper")
        await sweeper.beat()
        first_beat = time.monotonic()
        assert await sweeper.sweep() == 0  # it might be the one that was away: wait a lease
        async with asyncio.timeout(SWEPT_WITHIN_S):
            while not await sweeper.sweep():
                await asyncio.sleep(settings.gateway_heartbeat_s)
                await sweeper.beat()
        assert time.monotonic() - first_beat >= LEASE_S
        cancelled = await stack.wait_status(orphan, "cancelled")
        assert cancelled["text"]  # it had run: its partial text is kept
        last = parse_sse((await stack.client.get(f"/v1/jobs/{orphan}/events")).text)[-1]
        assert last[1] == "cancelled" and last[2]["reason"] == ORPHAN_REASON
        assert (await stack.client.get(f"/v1/jobs/{kept}")).json()["status"] == "running"
        assert await redis.zscore(keys.gateways(), "gone") is None
        assert not await redis.exists(keys.gateway_jobs("gone"))
        await sweeper.close()
        await stack.client.delete(f"/v1/jobs/{kept}")
