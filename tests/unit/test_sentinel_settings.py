"""Sentinel settings: one way to name Redis, addresses checked at start, WAIT's default, and
the passwords passed on to the processes genq starts (issue 16)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from genq.launcher import settings_env
from shared.redisconn import SentinelBlockingPool, connect
from shared.settings import RedisSettings, WorkerSettings

SENTINELS = "10.0.0.1:26379, 10.0.0.2:26379,[::1]:26380"


def sentinel_settings(**extra: object) -> RedisSettings:
    return RedisSettings(redis_sentinels=SENTINELS, redis_sentinel_master="genq", **extra)


def test_sentinels_are_a_comma_list_or_json() -> None:
    s = sentinel_settings()
    assert s.redis_sentinels == ["10.0.0.1:26379", "10.0.0.2:26379", "[::1]:26380"]
    assert s.redis_configured
    j = RedisSettings(redis_sentinels='["a:1","b:2"]', redis_sentinel_master="m")
    assert j.redis_sentinels == ["a:1", "b:2"]


@pytest.mark.parametrize("bad", ["host", "host:", ":26379", "host:port", "host:70000"])
def test_a_sentinel_that_is_not_host_port_stops_the_start(bad: str) -> None:
    with pytest.raises(ValidationError, match="is not host:port"):
        RedisSettings(redis_sentinels=bad, redis_sentinel_master="genq")


def test_a_url_and_sentinels_together_are_refused() -> None:
    with pytest.raises(ValidationError, match="give one, not both"):
        sentinel_settings(redis_url="redis://h:6379/0")


def test_sentinels_need_the_masters_name() -> None:
    with pytest.raises(ValidationError, match="GENQ_REDIS_SENTINEL_MASTER"):
        RedisSettings(redis_sentinels=SENTINELS)


def test_sentinel_only_settings_with_a_url_are_refused() -> None:
    with pytest.raises(ValidationError, match="GENQ_REDIS_PASSWORD: only with"):
        RedisSettings(redis_url="redis://h", redis_password="pw")


def test_wait_defaults_to_one_replica_with_sentinels_and_off_without() -> None:
    assert sentinel_settings().wait_replicas == 1
    assert RedisSettings(redis_url="redis://h").wait_replicas == 0
    assert sentinel_settings(redis_wait_replicas=0).wait_replicas == 0
    assert RedisSettings(redis_url="redis://h", redis_wait_replicas=2).wait_replicas == 2


def test_a_wait_as_long_as_the_socket_timeout_is_refused() -> None:
    with pytest.raises(ValidationError, match="GENQ_REDIS_WAIT_TIMEOUT_MS"):
        RedisSettings(redis_url="redis://h", redis_wait_timeout_ms=10_000)


def test_the_password_is_masked_in_reprs_but_reaches_a_launched_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = WorkerSettings(
        redis_sentinels=SENTINELS,
        redis_sentinel_master="genq",
        redis_password="s3cret",
        redis_sentinel_password="t0ps3cret",
    )
    assert "s3cret" not in repr(s)
    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)  # the child's only Redis: sentinels
    for name, value in settings_env(s).items():
        monkeypatch.setenv(name, value)
    child = WorkerSettings()
    assert child.redis_password is not None and child.redis_sentinel_password is not None
    assert child.redis_password.get_secret_value() == "s3cret"
    assert child.redis_sentinel_password.get_secret_value() == "t0ps3cret"
    assert child.redis_sentinels == s.redis_sentinels


async def test_connect_with_sentinels_gives_a_master_following_blocking_pool() -> None:
    client = connect(sentinel_settings(redis_password="pw"))
    pool = client.connection_pool
    assert isinstance(pool, SentinelBlockingPool)
    assert pool.is_master and pool.service_name == "genq"
    assert pool.connection_kwargs["password"] == "pw"
    assert [
        c.connection_pool.connection_kwargs["port"] for c in pool.sentinel_manager.sentinels
    ] == [
        26379,
        26379,
        26380,
    ]
    await client.aclose()
