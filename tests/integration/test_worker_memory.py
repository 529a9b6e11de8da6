"""What a worker keeps of a job after its end: only what rewriting that end needs (Redis may
lose its last writes), and only for the repair window, whether or not more jobs end."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from shared.settings import Settings
from tests.conftest import running_stack
from worker.jobstate import FinishedJob

WINDOW_S = 0.3


async def test_a_finished_job_leaves_its_prompt_and_tokens_and_then_the_rest(
    settings: Settings, redis: aioredis.Redis
) -> None:
    settings.log_repair_window_s = WINDOW_S
    async with running_stack(settings, redis) as stack:
        job = await stack.submit(prompt="word " * 2000, max_tokens=64)
        await stack.wait_status(job["id"], "succeeded")
        async with asyncio.timeout(5):  # the record may show the end a moment before
            while job["id"] not in stack.worker.st.finished:
                await asyncio.sleep(0.01)
        kept = stack.worker.st.finished[job["id"]][1]
        assert isinstance(kept, FinishedJob)  # not the running job with its spec and tokens
        assert not hasattr(kept, "spec") and not hasattr(kept, "token_ids")
        assert kept.end is not None and kept.recent  # what a repair needs is there
        # No other job ends: the heartbeat lets go of it once the window has passed.
        async with asyncio.timeout(WINDOW_S + 5 * settings.heartbeat_s + 2):
            while stack.worker.st.finished:
                await asyncio.sleep(0.05)
