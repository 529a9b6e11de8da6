"""Whether this process reaches Redis, as its commands find it: one warning when Redis is lost
("lost connection to Redis") and one info line when a command gets through again
("reconnected to Redis after X s"), however many calls failed in between.

It watches redis-py's retries (`ObservedRetry`, the retry policy `shared.redisconn.connect`
gives every client): each command, pipeline and connect runs through `call_with_retry`. One
failure that the retry mends at once (a connection Redis closed while idle) is no outage;
Redis is lost when one call fails twice in a row, or gives up; it is back when a connection
that failed succeeds again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff

log = logging.getLogger(__name__)
T = TypeVar("T")

LOST_AFTER_FAILURES = 2
"""Consecutive failures of one call that make an outage (a single one is mended by a retry)."""


class RedisHealth:
    """One per client, shared by the copies redis-py makes of its retry policy."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.lost_at: float | None = None
        """When Redis was lost (monotonic), while it is; None while it answers."""
        self.failures = 0
        """Failed tries (of commands, pipelines, connects) seen during the current outage."""

    @property
    def down(self) -> bool:
        return self.lost_at is not None

    def failed(self, error: BaseException) -> None:
        self.failures += 1
        if self.lost_at is None:
            self.lost_at = self._clock()
            log.warning("lost connection to Redis", extra={"error": str(error)})

    def answered(self) -> None:
        lost_at = self.lost_at
        if lost_at is None:
            return
        down_s = self._clock() - lost_at
        self.lost_at = None
        failures, self.failures = self.failures, 0
        log.info(
            "reconnected to Redis after %.1f s",
            down_s,
            extra={"down_s": round(down_s, 3), "failures": failures},
        )

    def level(self, usual: int = logging.WARNING) -> int:
        """The level of a caller's own line about a failed call: debug while the outage is
        already told, so that one outage is one warning, not one per call."""
        return logging.DEBUG if self.lost_at is not None else usual

    def __deepcopy__(self, memo: dict[int, Any]) -> RedisHealth:
        return self  # redis-py deep-copies the retry policy per connection: one state for all


class ObservedRetry(Retry):  # type: ignore[misc]  # redis-py is untyped here (pyproject)
    """redis-py's asyncio Retry, telling `health` what became of each call.

    redis-py gives each connection a copy of its client's retry policy, so a copy watches
    one connection: after a failure that connection is dropped and made again before its
    next call, so its next success proves Redis answers now. A success on a connection that
    has not failed proves nothing while Redis is lost: a pub/sub read may return what Redis
    sent before it went away, still buffered."""

    def __init__(
        self, backoff: AbstractBackoff, retries: int, health: RedisHealth | None = None
    ) -> None:
        super().__init__(backoff, retries)
        self.health = health or RedisHealth()
        self._failed = False
        """The last call of this copy's connection failed (it reconnects before the next)."""

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: Any,
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        health = self.health
        failures = 0

        async def attempt() -> T:
            nonlocal failures
            try:
                return await do()
            except self._supported_errors as exc:
                failures += 1
                self._failed = True
                if failures >= LOST_AFTER_FAILURES or health.down:
                    health.failed(exc)
                raise

        try:
            result: T = await super().call_with_retry(
                attempt, fail, is_retryable, with_failure_count
            )
        except self._supported_errors as exc:
            if not health.down:  # gave up sooner than `attempt` would tell
                health.failed(exc)
            raise
        if self._failed:
            self._failed = False
            health.answered()
        return result


def health_of(client: object) -> RedisHealth | None:
    """The health a client made by `shared.redisconn.connect` reports to; None for others
    (fakeredis, a client a test made)."""
    get_retry = getattr(client, "get_retry", None)
    retry = get_retry() if callable(get_retry) else None
    return retry.health if isinstance(retry, ObservedRetry) else None


def failure_level(client: object, usual: int = logging.WARNING) -> int:
    """The level of a line about a failed Redis call of `client`: `usual`, or debug while the
    outage it belongs to is already logged (`RedisHealth.level`)."""
    health = health_of(client)
    return usual if health is None else health.level(usual)
