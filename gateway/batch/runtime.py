"""What a gateway process runs for batches: the services behind the routes, and the driver's
and the tracker's loops, started and stopped by the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.batch.driver import BatchDriver
from gateway.batch.files import FileService
from gateway.batch.finalize import Finalizer
from gateway.batch.service import BatchService
from gateway.batch.storage import FileStore, RedisFileStore
from gateway.batch.tracker import BatchTracker
from gateway.state import GatewayState


class BatchRuntime:
    def __init__(self, state: GatewayState, store: FileStore | None = None) -> None:
        store = store or RedisFileStore(state.redis, state.keys)
        self.files = FileService(state, store)
        self.driver = BatchDriver(state, store, Finalizer(state, self.files))
        self.tracker = BatchTracker(state, self.driver.wake)
        self.batches = BatchService(state, self.files, self.driver.wake)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.driver.loop(), name="batch-driver"),
            asyncio.create_task(self.tracker.loop(), name="batch-tracker"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
