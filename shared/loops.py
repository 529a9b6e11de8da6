"""The background loops of gateways and workers (heartbeats, sweeps, repairs, claims): run a
step again and again for the life of the process, and when the step's Redis call fails, log
it, pause, and go on. A loop that ended on a Redis error would leave its work undone until a
restart; one that logged every failed call of an outage at warning would drown the one line
that says Redis is lost (`shared.redis_health`)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from shared.redis_health import failure_level

LOOP_RESTART_S = 0.5
"""Pause before a loop's next step after one failed (Redis away, a loop restarted), so a
failure that repeats at once does not spin."""
REDIS_FAILURES: tuple[type[Exception], ...] = (RedisError, OSError)
"""What a Redis call raises when Redis is away or answers an error."""


def _forever() -> bool:
    return True


def honour_cancel() -> None:
    """Raise CancelledError in a task that was cancelled when the cancel did not reach it: a
    Redis client may swallow one that lands inside a command (seen with redis-py 8 and
    fakeredis), and a loop that goes on then keeps its gateway or worker from shutting down.
    Loops call it between rounds, outside any timeout scope (whose own cancel it would see)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def keep_running(
    step: Callable[[], Awaitable[object]],
    *,
    failed: str,
    log: logging.Logger,
    every_s: float,
    redis: object = None,
    pause_first: bool = True,
    retry_s: float = 0.0,
    running: Callable[[], bool] = _forever,
    on_failure: Callable[[Exception], Awaitable[None] | None] | None = None,
) -> None:
    """Run `step` while `running()`, pausing `every_s` (0: not at all) before each step
    (`pause_first`) or after it. A step whose Redis call fails (`REDIS_FAILURES`) is logged
    as `failed` on `log` (at warning, or debug while the outage of `redis`'s client is
    already logged), then `on_failure` sees the error, and the loop goes on after `retry_s`
    more. Anything else ends the loop (a bug: its supervisor logs it), as does cancellation."""
    while running():
        if pause_first and every_s:
            await asyncio.sleep(every_s)
        honour_cancel()
        try:
            await step()
        except REDIS_FAILURES as exc:
            log_failure(log, redis, failed, exc)
            if on_failure is not None:
                done = on_failure(exc)
                if inspect.isawaitable(done):
                    await done
            if retry_s:
                await asyncio.sleep(retry_s)
        honour_cancel()
        if not pause_first and every_s:
            await asyncio.sleep(every_s)


async def one_process_each_round(
    sweep: Callable[[], Awaitable[object]],
    *,
    lock: str,
    failed: str,
    log: logging.Logger,
    every_s: float,
    redis: Any,
) -> None:
    """`keep_running` for a sweep that one process of the fleet runs per round: each round
    the process that takes the Redis lock `lock` (SET NX, lasting one round) sweeps; the
    others wait for the next."""
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lease_ms = int(every_s * 1000)

    async def step() -> None:
        if await redis.set(lock, token, nx=True, px=lease_ms):
            await sweep()

    await keep_running(step, failed=failed, log=log, every_s=every_s, redis=redis)


def log_failure(log: logging.Logger, redis: object, failed: str, exc: BaseException) -> None:
    """One line about a failed Redis call: at warning, or debug during an outage already
    logged (`failure_level`)."""
    log.log(failure_level(redis), failed, extra={"error": str(exc)})
