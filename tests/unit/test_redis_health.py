"""shared/redis_health.py: when a process says Redis is lost and back, from redis-py's
retries (the end-to-end test kills a real redis-server)."""

from __future__ import annotations

import copy
import logging

import pytest
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.redis_health import ObservedRetry, RedisHealth, failure_level, health_of
from shared.redisconn import connect, is_transient
from shared.settings import RedisSettings

RETRIES = 3


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _flaky(failures: int) -> object:
    """An operation failing `failures` times, then answering."""
    left = [failures]

    async def do() -> str:
        if left[0] > 0:
            left[0] -= 1
            raise RedisConnectionError("Error 111 connecting: Connection refused.")
        return "OK"

    return do


async def _noop(error: Exception, failures: int | None = None) -> None:
    return None


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "shared.redis_health"
    ]


@pytest.fixture
def policy() -> tuple[ObservedRetry, Clock]:
    clock = Clock()
    return ObservedRetry(NoBackoff(), RETRIES, RedisHealth(clock)), clock


async def test_one_failure_the_retry_mends_is_no_outage(
    policy: tuple[ObservedRetry, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    retry, _ = policy
    caplog.set_level(logging.INFO)
    assert await retry.call_with_retry(_flaky(1), _noop) == "OK"
    assert _said(caplog) == [] and not retry.health.down


async def test_an_outage_is_one_warning_then_one_line_when_a_failed_connection_answers(
    policy: tuple[ObservedRetry, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    retry, clock = policy
    other = copy.deepcopy(retry)  # another connection's copy, as redis-py makes them
    assert other.health is retry.health
    caplog.set_level(logging.INFO)
    for _ in range(3):
        with pytest.raises(RedisConnectionError):
            await retry.call_with_retry(_flaky(RETRIES + 1), _noop)
    assert _said(caplog) == [("WARNING", "lost connection to Redis")]
    assert failure_level(_Client(retry)) == logging.DEBUG
    clock.now += 4.25
    await other.call_with_retry(_flaky(0), _noop)  # e.g. a buffered pub/sub reply: no proof
    assert retry.health.down
    await retry.call_with_retry(_flaky(0), _noop)
    assert _said(caplog)[1:] == [("INFO", "reconnected to Redis after 4.2 s")]
    back = caplog.records[-1].__dict__
    assert back["down_s"] == 4.25 and back["failures"] == 3 * (RETRIES + 1) - 1
    assert failure_level(_Client(retry)) == logging.WARNING


async def test_a_call_that_gives_up_at_once_is_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    retry = ObservedRetry(NoBackoff(), 0)
    caplog.set_level(logging.INFO)
    with pytest.raises(RedisConnectionError):
        await retry.call_with_retry(_flaky(1), _noop)
    assert _said(caplog) == [("WARNING", "lost connection to Redis")]


class _Client:
    def __init__(self, retry: ObservedRetry) -> None:
        self._retry = retry

    def get_retry(self) -> ObservedRetry:
        return self._retry


async def test_clients_genq_makes_report_their_health() -> None:
    client = connect(RedisSettings(redis_url="redis://127.0.0.1:1/0"))
    try:
        health = health_of(client)
        assert isinstance(health, RedisHealth)
        assert health_of(object()) is None and failure_level(object()) == logging.WARNING
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "error",
    [
        ClusterDownError("The cluster is down"),
        MovedError("3999 127.0.0.1:6381"),
        AskError("3999 127.0.0.1:6381"),
        SlotNotCoveredError("Slot 3999 is not covered by the cluster."),
        TryAgainError("Multiple keys request during rehashing of slot"),
        ResponseError("CLUSTERDOWN The cluster is down"),
    ],
)
def test_a_cluster_failing_over_is_transient_not_a_rejected_write(error: Exception) -> None:
    """While a primary fails over, every node answers CLUSTERDOWN (and a moved slot MOVED):
    a worker's writes answered so go again later. Classed as a refusal of the write itself,
    each cost its job a counted attempt: a job started in the failover ran out of them and
    failed (the cluster kill test, once in some 25 runs)."""
    assert is_transient(error)
    assert not is_transient(ResponseError("WRONGTYPE Operation against a key"))
