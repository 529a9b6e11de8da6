"""The gateway's lifespan unwinds what it started when a later step of its start fails: no
background task left running, presence cleared, the Redis client it made closed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway import app as app_module
from gateway import queues
from gateway.batch.runtime import BatchRuntime
from shared.keys import Keys
from shared.redisconn import connect
from shared.settings import Settings

BEAT_WAIT_S = 5.0


class StartFailed(Exception):
    pass


def _running_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


@pytest.mark.parametrize("failing", ["queue groups", "batch loops"])
async def test_a_failed_start_unwinds_what_started_before_it(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    made: list[aioredis.Redis] = []
    closed: list[aioredis.Redis] = []

    def connecting(s: Settings) -> aioredis.Redis:
        client = connect(s)
        real_close = client.aclose

        async def aclose(*args: Any, **kwargs: Any) -> None:
            closed.append(client)
            await real_close(*args, **kwargs)

        client.aclose = aclose  # type: ignore[method-assign]
        made.append(client)
        return client

    app = app_module.create_app(settings)
    keys = Keys(settings.key_prefix)
    observer = connect(settings)
    real_start = queues.start

    async def start_groups(*args: Any) -> asyncio.Task[None]:
        # the loops started before this step have run: presence has announced the gateway
        presence_id = app.state.genq.presence.id
        async with asyncio.timeout(BEAT_WAIT_S):
            while await observer.zscore(keys.gateways(), presence_id) is None:
                await asyncio.sleep(0.01)
        if failing == "queue groups":
            raise StartFailed
        return await real_start(*args)

    def start_batches(self: BatchRuntime) -> None:
        raise StartFailed

    monkeypatch.setattr(app_module, "connect", connecting)
    monkeypatch.setattr(queues, "start", start_groups)
    monkeypatch.setattr(BatchRuntime, "start", start_batches)
    before = _running_tasks()
    try:
        with pytest.raises(StartFailed):
            async with app.router.lifespan_context(app):
                pytest.fail("the lifespan started")
        assert _running_tasks() == before  # router, sweeps, presence, fleet, queue groups
        assert made and closed == made  # the client the app made, closed
        assert await observer.zscore(keys.gateways(), app.state.genq.presence.id) is None
    finally:
        await observer.aclose()
