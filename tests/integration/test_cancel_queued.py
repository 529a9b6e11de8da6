"""DELETE of a job that is still queued cancels it and answers 200 (it once answered 409)."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared.settings import Settings
from tests.conftest import running_stack


async def test_deleting_a_queued_job_cancels_it(settings: Settings, redis: aioredis.Redis) -> None:
    async with running_stack(settings, redis, max_batch=1, step_ms=50.0) as stack:
        blocker = await stack.submit(prompt="x", max_tokens=1000)
        await stack.wait_status(blocker["id"], "running")
        queued = await stack.submit(prompt="x", max_tokens=5)
        r = await stack.client.delete(f"/v1/jobs/{queued['id']}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        again = await stack.client.delete(f"/v1/jobs/{queued['id']}")
        assert again.status_code == 409
        assert (await stack.client.delete(f"/v1/jobs/{blocker['id']}")).status_code == 200
