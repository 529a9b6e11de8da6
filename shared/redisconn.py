"""Redis clients with retries and health checks set explicitly (never version defaults)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.settings import RedisSettings

RETRY_ON = (RedisConnectionError, RedisTimeoutError, ConnectionResetError)


def connect(settings: RedisSettings, url: str | None = None, **overrides: Any) -> aioredis.Redis:
    """An asyncio client for `url` (default: settings.redis_url); responses decoded to str."""
    target = url or settings.redis_url
    if not target:
        raise ValueError("no Redis URL: set GENQ_REDIS_URL (or use `genq serve`)")
    options: dict[str, Any] = dict(
        # Blocking: a burst of streams waits for a free connection instead of failing.
        connection_pool_class=aioredis.BlockingConnectionPool,
        timeout=settings.redis_pool_timeout_s,
        decode_responses=True,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), settings.redis_retries),
        retry_on_error=list(RETRY_ON),
        health_check_interval=settings.redis_health_check_s,
        socket_timeout=settings.redis_socket_timeout_s,
        socket_connect_timeout=settings.redis_socket_timeout_s,
        socket_keepalive=True,
        max_connections=settings.redis_max_connections,
    )
    options.update(overrides)
    pool = options.pop("connection_pool_class").from_url(target, **options)
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) its pool
