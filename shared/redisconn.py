"""Redis clients with retries and health checks set explicitly (never version defaults).

Redis is named by a URL, by Sentinels that say where the master is now, or by a Redis
Cluster's seed nodes: `connect` builds any of them. A Sentinel-managed client asks them again
on every new connection, so after a failover the next command reaches the promoted replica;
a cluster client (redis-py's `RedisCluster`) learns the slot map from the seeds and follows
MOVED, ASK and failovers by itself (the slot plan: shared/keys.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis._parsers.commands import AsyncCommandsParser
from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
from redis._parsers.hiredis import _AsyncHiredisParser
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.redis_health import ObservedRetry
from shared.settings import RedisSettings, sentinel_address

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # redis-py works without it (its Python packer and parser)
    _hiredis_pack = None

RETRY_ON = (RedisConnectionError, RedisTimeoutError, ConnectionResetError)
TRANSIENT = (
    *RETRY_ON,
    OSError,
    OutOfMemoryError,  # OOM: at maxmemory with noeviction, until memory frees up
    BusyLoadingError,  # LOADING: a restarted Redis reading its AOF
    ReadOnlyError,  # READONLY: a replica, before a failover promotes it or clients move
    MasterDownError,  # MASTERDOWN
    NoScriptError,  # NOSCRIPT: a restarted Redis forgot the scripts (the runner reloads)
    TryAgainError,
    # A Redis Cluster failing over or resharding: CLUSTERDOWN (no primary for a slot yet,
    # every node answers it while a failover is under way), MOVED / ASK (a slot that moved:
    # the client reads the slot map again), a slot no node serves yet
    ClusterDownError,
    AskError,  # MovedError is one
    SlotNotCoveredError,
)
_TRANSIENT_REPLIES = (
    "BUSY ",
    "OOM ",
    "LOADING ",
    "READONLY ",
    "MASTERDOWN ",
    "NOSCRIPT ",
    "NOREPLICAS ",  # min-replicas-to-write: too few replicas in sync, until one catches up
    "CLUSTERDOWN ",
    "MOVED ",
    "ASK ",
    "TRYAGAIN ",
)
"""Error replies of a Redis that will take the same command again shortly (BUSY: a script
or module ran long), however the client library names them."""

TCP_ONLY = ("socket_keepalive", "socket_keepalive_options", "socket_type")
"""Options of redis-py's TCP connection (and its TLS one) that its unix-socket connection does
not take: passed to one, its constructor raises TypeError at the first command. Likewise the
`ssl_*` options, which only its TLS connection (`rediss://`) takes."""


class RespPacker:
    """Packs a command into the Redis protocol in one call of hiredis's C packer. redis-py's
    own hiredis path first encodes each argument in Python (a type check and an encode per
    argument): for the scripts genq runs by the thousand a second, a dozen or more arguments
    each, that loop cost ~9 times the packing itself (measured: docs/performance.md, "Tiny
    jobs"). What hiredis will not pack as redis-py would (a bool, None, a str that is not
    UTF-8) goes to redis-py's packer, which packs it or raises as it always did."""

    def __init__(self, fallback: Callable[..., list[bytes]]) -> None:
        self._fallback = fallback

    def pack(self, *args: Any) -> list[bytes]:
        first = args[0]
        if isinstance(first, str) and " " in first:  # "CLIENT UNBLOCK": two words, as redis-py
            args = (*first.split(), *args[1:])
        assert _hiredis_pack is not None  # `fast_packing` makes none otherwise
        try:
            return [_hiredis_pack(args)]
        except (TypeError, UnicodeEncodeError):
            return self._fallback(*args)


def fast_packing(conn: AbstractConnection) -> AbstractConnection:
    """`conn` packing its commands with `RespPacker` (where hiredis is there and the
    connection encodes as UTF-8, as hiredis does)."""
    if _hiredis_pack is None or conn.encoder.encoding.replace("-", "").lower() != "utf8":
        return conn
    packer = conn._command_packer  # redis-py's own: the fallback
    fallback = packer.pack if packer is not None else conn._pack_command_python
    conn._command_packer = RespPacker(fallback)
    return conn


class FastReader:
    """A connection's `read_response` that takes a reply hiredis holds already straight from
    its reader. redis-py's own path arms an asyncio timeout (a timer scheduled and cancelled)
    and goes through three coroutines for every reply, also for the replies of a pipeline
    that all came in one read: ~10 of the ~16 µs of CPU a pipelined command costs a genq
    process (measured: docs/performance.md, "Tiny jobs"). A reply not there yet, and every
    read that asks for something else (a timeout, raw bytes, a push), goes the usual way."""

    __slots__ = ("_conn", "_slow")

    def __init__(self, conn: AbstractConnection) -> None:
        self._conn = conn
        self._slow = conn.read_response

    async def read_response(
        self,
        disable_decoding: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109 (redis-py's signature)
        *,
        disconnect_on_error: bool = True,
        push_request: bool | None = False,
    ) -> Any:
        conn = self._conn
        parser: Any = conn._parser
        reader = parser._reader
        if disable_decoding or timeout is not None or push_request or reader is None:
            return await self._slow(
                disable_decoding,
                timeout,
                disconnect_on_error=disconnect_on_error,
                push_request=push_request,
            )
        push_type = parser._hiredis_PushNotificationType
        while True:
            if not parser._connected:  # as the parser: no reads once disconnected
                break
            response = reader.gets()
            if response is _NOT_ENOUGH_DATA:
                break
            if push_type is not None and isinstance(response, push_type):
                await parser.handle_push_response(response)
                continue  # then the reply it came before, as the parser does
            error = response
            if isinstance(response, list) and response:
                error = response[0]
            if isinstance(error, RedisConnectionError):  # e.g. LOADING: as redis-py, dropped
                if disconnect_on_error:
                    await conn.disconnect(nowait=True)
                raise error
            if conn.health_check_interval:
                loop = asyncio.get_running_loop()
                conn.next_health_check = loop.time() + conn.health_check_interval
            if isinstance(response, ResponseError):
                raise response
            return response
        return await self._slow(
            disable_decoding, timeout, disconnect_on_error=disconnect_on_error, push_request=False
        )


def fast_reading(conn: AbstractConnection) -> AbstractConnection:
    """`conn` reading replies hiredis holds already without redis-py's timer (`FastReader`),
    where its parser is hiredis's."""
    if isinstance(conn._parser, _AsyncHiredisParser):
        conn.read_response = FastReader(conn).read_response
    return conn


class BlockingPool(aioredis.BlockingConnectionPool):  # type: ignore[misc]
    """redis-py's blocking pool, its connections packing with `RespPacker` and reading with
    `FastReader`."""

    def make_connection(self) -> AbstractConnection:
        return fast_reading(fast_packing(super().make_connection()))


def is_transient(exc: BaseException) -> bool:
    """Whether a command that failed with `exc` should simply be sent again later: the Redis
    is restarting, full, busy or failing over, not refusing this command for what it is (a
    WRONGTYPE is not transient: the key is damaged, and sending it again changes nothing)."""
    if isinstance(exc, TRANSIENT):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES)


def connect(settings: RedisSettings, url: str | None = None, **overrides: Any) -> aioredis.Redis:
    """An asyncio client for `url` (default: settings.redis_url, else the sentinels' master);
    responses decoded to str."""
    target = url or settings.redis_url
    if not target and settings.redis_cluster:
        return cluster_client(settings, **overrides)
    if not target and not settings.redis_sentinels:
        raise ValueError("no Redis URL: set GENQ_REDIS_URL (or use `genq serve`)")
    options: dict[str, Any] = dict(
        # Blocking: a burst of streams waits for a free connection instead of failing.
        connection_pool_class=BlockingPool,
        timeout=settings.redis_pool_timeout_s,
        decode_responses=True,
        # Anything genq writes is UTF-8; bytes that are not (a forged queue entry, a pickle)
        # decode with U+FFFD and fail validation where they are read, instead of failing the
        # whole reply they came in (one bad entry would stall a queue read forever).
        encoding_errors="replace",
        # observed: one line when Redis is lost and one when it is back (shared/redis_health)
        retry=ObservedRetry(
            ExponentialWithJitterBackoff(base=0.05, cap=2.0), settings.redis_retries
        ),
        retry_on_error=list(RETRY_ON),
        health_check_interval=settings.redis_health_check_s,
        socket_timeout=settings.redis_socket_timeout_s,
        socket_connect_timeout=settings.redis_socket_timeout_s,
        socket_keepalive=True,  # TCP only: dropped below for a unix socket
        max_connections=settings.redis_max_connections,
    )
    options.update(overrides)
    if not target:
        return _master_client(settings, options)  # sentinels hand out host:port: always TCP
    check_url(target)
    if _is_unix_socket(target):
        for name in TCP_ONLY:
            options.pop(name, None)
    pool = options.pop("connection_pool_class").from_url(target, **options)
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) its pool


def check_url(url: str) -> None:
    """ValueError naming each option `url` sets that its transport does not take (redis-py
    would pass it on, to fail at the first command): a TCP-only one in a unix:// URL, an ssl_*
    one in any but a rediss:// URL. The message never quotes the URL: it may hold a password."""
    parsed = parse_url(url)  # ValueError: a scheme or option value redis-py does not read
    transport = parsed.get("connection_class")
    refused = [
        f"{name}: TCP only, a unix:// URL has no such option"
        for name in parsed
        if transport is UnixDomainSocketConnection and name in TCP_ONLY
    ]
    refused += [
        f"{name}: TLS only, in a rediss:// URL"
        for name in parsed
        if name.startswith("ssl_") and transport is not SSLConnection
    ]
    if refused:
        raise ValueError("redis_url option " + "; ".join(refused))


def _is_unix_socket(url: str) -> bool:
    return parse_url(url).get("connection_class") is UnixDomainSocketConnection


class SentinelBlockingPool(SentinelConnectionPool, BlockingPool):  # type: ignore[misc]
    """Sentinel's master-following pool that waits for a free connection, as the URL one
    does, rather than failing a burst; closing it closes its sentinel clients too."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # the client's close (a master change drops idle ones only)
            await self.sentinel_manager.aclose()


def sentinels(settings: RedisSettings) -> Sentinel:
    """Clients of the sentinels themselves (asked where the master is, never for data)."""
    password = settings.redis_sentinel_password
    return Sentinel(
        [sentinel_address(a) for a in settings.redis_sentinels],
        sentinel_kwargs=dict(
            password=password.get_secret_value() if password else None,
            decode_responses=True,
            socket_timeout=settings.redis_socket_timeout_s,
            socket_connect_timeout=settings.redis_socket_timeout_s,
            socket_keepalive=True,
        ),
    )


def _master_client(settings: RedisSettings, options: dict[str, Any]) -> aioredis.Redis:
    assert settings.redis_sentinel_master is not None  # the settings refuse sentinels without
    options.pop("connection_pool_class")
    password = settings.redis_password
    return sentinels(settings).master_for(
        settings.redis_sentinel_master,
        connection_pool_class=SentinelBlockingPool,
        username=settings.redis_username,
        password=password.get_secret_value() if password else None,
        **options,
    )


def is_cluster(redis: Any) -> bool:
    """Whether `redis` is a Redis Cluster client (scripts then run split per slot)."""
    return isinstance(redis, RedisCluster)


def cluster_client(settings: RedisSettings, **overrides: Any) -> Any:
    """An asyncio `RedisCluster` of the seed nodes GENQ_REDIS_CLUSTER names, with the same
    timeouts, retries and password as the single client; responses decoded to str. Typed Any:
    it answers the commands genq sends as `aioredis.Redis` does (its pipelines split per
    node), and mypy cannot see that through redis-py's two class trees."""
    password = settings.redis_password
    options: dict[str, Any] = dict(
        startup_nodes=[ClusterNode(*sentinel_address(a)) for a in settings.redis_cluster],
        decode_responses=True,
        encoding_errors="replace",
        username=settings.redis_username,
        password=password.get_secret_value() if password else None,
        ssl=settings.redis_cluster_tls,
        retry=ObservedRetry(
            ExponentialWithJitterBackoff(base=0.05, cap=2.0), settings.redis_retries
        ),
        health_check_interval=settings.redis_health_check_s,
        socket_timeout=settings.redis_socket_timeout_s,
        socket_connect_timeout=settings.redis_socket_timeout_s,
        socket_keepalive=True,
        max_connections=settings.redis_max_connections,
    )
    options.update(overrides)
    client = RedisCluster(**options)
    client.commands_parser = StreamKeysParser()  # before `initialize` fills it
    return client


class StreamKeysParser(AsyncCommandsParser):  # type: ignore[misc]  # redis-py: untyped
    """redis-py's cluster client finds the keys of a command with movable keys from the
    command's key specs, and asks the server (COMMAND GETKEYS, one round trip more) when it
    cannot: for XREADGROUP and XREAD, whose keys follow the STREAMS keyword, always. genq
    reads its queues with XREADGROUP, so that was a command more per claim read (2.3 a job on
    the cluster bench). Their keys are found here instead; anything else goes on as before."""

    async def get_keys(self, *args: Any) -> tuple[str, ...] | None:
        keys = stream_keys(args)
        if keys is not None:
            return keys
        found: tuple[str, ...] | None = await super().get_keys(*args)
        return found


_READ_OPTIONS = {"COUNT": 1, "BLOCK": 1, "NOACK": 0}
"""XREAD(GROUP)'s options before STREAMS, and the arguments each takes."""


def stream_keys(args: tuple[Any, ...]) -> tuple[str, ...] | None:
    """The stream keys of an XREADGROUP or XREAD command (name first), as the server finds
    them; None for another command, or one whose shape is not that (the server decides)."""
    if not args:
        return None
    name = _text(args[0]).upper()
    if name == "XREADGROUP":
        if len(args) < 4 or _text(args[1]).upper() != "GROUP":
            return None
        i = 4  # GROUP group consumer
    elif name == "XREAD":
        i = 1
    else:
        return None
    while i < len(args):
        word = _text(args[i]).upper()
        if word == "STREAMS":
            rest = args[i + 1 :]
            if not rest or len(rest) % 2:
                return None
            return tuple(_text(k) for k in rest[: len(rest) // 2])
        taken = _READ_OPTIONS.get(word)
        if taken is None:
            return None
        i += 1 + taken
    return None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
