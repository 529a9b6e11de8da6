"""What a gateway process runs for batches: the services behind the routes, and the driver's
and the tracker's loops, started and stopped by the app's lifespan."""

from __future__ import annotations

import asyncio

from gateway.batch.driver import BatchDriver
from gateway.batch.files import FileService
from gateway.batch.finalize import Finalizer
from gateway.batch.service import BatchService
from gateway.batch.storage import FileStore, RedisFileStore
from gateway.batch.tracker import BatchTracker
from gateway.state import GatewayState

STOP_POLL_S = 0.1


class BatchRuntime:
    def __init__(self, state: GatewayState, store: FileStore | None = None) -> None:
        self.settings = state.settings
        store = store or RedisFileStore(state.redis, state.keys)
        self.files = FileService(state, store)
        self.driver = BatchDriver(state, store, Finalizer(state, self.files))
        self.tracker = BatchTracker(state, self.driver.wake)
        self.batches = BatchService(state, self.files, self.driver.wake)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """The loops, unless GENQ_BATCH_LOOPS is off (then other gateways run them)."""
        if not self.settings.batch_loops:
            return
        self._tasks = [
            asyncio.create_task(self.driver.loop(), name="batch-driver"),
            asyncio.create_task(self.tracker.loop(), name="batch-tracker"),
        ]

    async def stop(self) -> None:
        """Stop both loops. A cancel that lands inside a redis-py read can come back as a
        RedisError, which the loops retry: they also stop on their flag, and are cancelled
        again until they are gone."""
        self.driver.closing = self.tracker.closing = True
        stuck = set(self._tasks)
        while stuck:
            for task in stuck:
                task.cancel()
            _, stuck = await asyncio.wait(stuck, timeout=STOP_POLL_S)
        self._tasks = []
