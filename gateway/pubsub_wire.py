"""Pub/sub connections for the gateway's router: a lean raw one, and redis-py's as fallback.

The raw connection is an asyncio Protocol that parses with hiredis and hands each message
to the router straight from `data_received`: no task wake-up, no await, no per-message
wrapper objects. redis-py's PubSub costs several times more per message, and the gateway
handles one message per job per worker flush, so this is its hottest path. The fallback
(`RedisPyPubSub`) serves in-process fakeredis and anything the raw one cannot reach.

The raw connection reads its address, credentials and TLS settings through redis-py's own
URL parsing (`Endpoint.from_url`), and refuses at start any URL option it cannot honour:
a gateway never subscribes somewhere else, or with less security, than its URL says. With
Sentinel (`SentinelMaster`) it asks the sentinels for the master before every connection:
a failover drops it (the old master dies, or the sentinels demote it and close its
clients), and it subscribes again wherever the master is now.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.asyncio.sentinel import Sentinel
from redis.credentials import UsernamePasswordCredentialProvider
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

OnMessage = Callable[[str, str], None]
OnSubscribed = Callable[[str], None]
_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 2.0
_POLL_S = 1.0

PING_INTERVAL_S = 2.0
"""The raw connection PINGs this often after each PONG. A peer gone without a FIN (a network
partition, a stopped Redis) sends nothing, and a subscribed connection waiting for messages
cannot tell that from a quiet one; the PING makes silence mean something."""
PONG_TIMEOUT_S = 3.0
"""No PONG and no other reply this long after a PING: the connection is dropped and made
again (replies still arriving mean the PONG is queued behind them, and extend the wait)."""

_DEFAULT_HOST = "localhost"  # redis-py's, for a URL that names none
_DEFAULT_PORT = 6379
_NAME_CHARS = frozenset(map(chr, range(ord("!"), ord("~") + 1)))
"""What CLIENT SETNAME takes."""
_TLS_OPTIONS = frozenset(
    p for p in inspect.signature(SSLConnection.__init__).parameters if p.startswith("ssl_")
)
"""Handed to redis-py's SSLConnection, which builds the context: honoured as redis-py does."""
_HONOURED = frozenset(
    {"host", "port", "path", "username", "password", "client_name", "socket_connect_timeout"}
)
NOT_APPLICABLE = {
    "db": "pub/sub channels are global: a message reaches subscribers of every db",
    "socket_timeout": "a subscribed connection waits for messages by design; the PING timer "
    "bounds its silence",
    "health_check_interval": "the PING timer checks this connection",
    "socket_keepalive": "the PING timer notices a dead peer sooner than TCP keepalive",
    "retry_on_timeout": "this connection always reconnects",
    "max_connections": "sizes redis-py's pool; this is one connection",
    "timeout": "the wait for a free pooled connection; this is one connection",
    "socket_read_size": "the transport hands over whatever arrived",
    "protocol": "a message reads the same in RESP2, which this connection speaks",
    "legacy_responses": "shapes redis-py's command replies; this connection has none",
}
"""URL options that configure redis-py's pooled client, whose job this connection does its
own way: accepted, so one URL serves both. Any option in neither table stops the start."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how the raw connection reaches Redis, read from a redis-py URL."""

    host: str
    port: int
    connect_timeout_s: float
    path: str | None = None
    """A unix socket: redis-py's `unix:///path/to/redis.sock`."""
    tls: ssl.SSLContext | None = None
    auth: tuple[str, ...] = field(default=(), repr=False)
    """AUTH's arguments, as redis-py sends them: ([username,] password)."""
    username: str | None = None
    client_name: str | None = None

    @classmethod
    def from_url(cls, url: str, connect_timeout_s: float) -> Endpoint:
        """ValueError naming the option, for any the raw connection cannot honour. The
        message never quotes the URL: it may carry a password."""
        opts: dict[str, Any] = dict(parse_url(url))  # ValueError: bad scheme or value
        connection_class = opts.pop("connection_class", None)
        _refuse_unhonoured(opts, tls=connection_class is SSLConnection)
        username, password = opts.get("username"), opts.get("password")
        auth = UsernamePasswordCredentialProvider(username, password).get_credentials()
        tls = {k: v for k, v in opts.items() if k in _TLS_OPTIONS}
        path = opts.get("path")
        client_name = opts.get("client_name")
        if client_name is not None and not _NAME_CHARS.issuperset(client_name):
            raise ValueError("redis_url option client_name: Redis takes printable ASCII, no spaces")
        if connection_class is UnixDomainSocketConnection and not path:
            raise ValueError("redis_url: a unix:// URL needs the socket's path")
        return cls(
            host=str(opts.get("host", _DEFAULT_HOST)),
            port=int(opts.get("port", _DEFAULT_PORT)),
            connect_timeout_s=float(opts.get("socket_connect_timeout", connect_timeout_s)),
            path=path,
            tls=tls_context(tls) if connection_class is SSLConnection else None,
            auth=tuple(auth) if username or password else (),
            username=username,
            client_name=client_name,
        )

    @property
    def where(self) -> str:
        """For logs: the address, never the credentials."""
        if self.path is not None:
            return f"unix:{self.path}"
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}"

    async def connect(self, protocol: Callable[[], asyncio.Protocol]) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            if self.path is not None:
                await loop.create_unix_connection(protocol, self.path)
            else:
                await loop.create_connection(protocol, self.host, self.port, ssl=self.tls)


class Target(Protocol):
    """Where the next connection goes: one fixed endpoint, or wherever the master is now."""

    @property
    def where(self) -> str: ...

    async def locate(self) -> Endpoint: ...


@dataclass(frozen=True)
class Fixed:
    endpoint: Endpoint

    @property
    def where(self) -> str:
        return self.endpoint.where

    async def locate(self) -> Endpoint:
        return self.endpoint


@dataclass
class SentinelMaster:
    """The master the sentinels name now; `template` holds the credentials and timeouts."""

    sentinels: Sentinel
    master: str
    template: Endpoint
    _last: Endpoint | None = None

    @classmethod
    def of(
        cls,
        sentinels: Sentinel,
        master: str,
        connect_timeout_s: float,
        username: str | None,
        password: str | None,
    ) -> SentinelMaster:
        auth = UsernamePasswordCredentialProvider(username, password).get_credentials()
        template = Endpoint(
            host="",
            port=0,
            connect_timeout_s=connect_timeout_s,
            auth=tuple(auth) if username or password else (),
            username=username,
        )
        return cls(sentinels, master, template)

    @property
    def where(self) -> str:
        at = f" at {self._last.where}" if self._last is not None else ""
        return f"sentinel master {self.master}{at}"

    async def locate(self) -> Endpoint:
        """OSError when no sentinel names a master (one is being elected): retried."""
        try:
            host, port = await self.sentinels.discover_master(self.master)
        except RedisError as exc:
            raise ConnectionError(str(exc)) from exc
        self._last = replace(self.template, host=str(host), port=int(port))
        return self._last

    async def aclose(self) -> None:
        await self.sentinels.aclose()


def _refuse_unhonoured(opts: dict[str, Any], *, tls: bool) -> None:
    unknown = sorted(o for o in opts if o not in _HONOURED | _TLS_OPTIONS | NOT_APPLICABLE.keys())
    if unknown:
        raise ValueError(
            f"redis_url option(s) {', '.join(unknown)}: the gateway's pub/sub connection "
            f"cannot honour them (it honours {', '.join(sorted(_HONOURED | _TLS_OPTIONS))}; "
            f"and accepts {', '.join(sorted(NOT_APPLICABLE))}, which it has no use for)"
        )
    tls_given = sorted(o for o in opts if o in _TLS_OPTIONS)
    if tls_given and not tls:
        raise ValueError(f"redis_url option(s) {', '.join(tls_given)}: TLS needs rediss://")


def tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """redis-py's own context for these options (its defaults: certificate and host name
    verified), built now so a missing or bad file stops the start."""
    try:
        context: ssl.SSLContext = SSLConnection(**options).ssl_context.get()
        return context
    except (RedisError, OSError, ValueError) as exc:
        names = ", ".join(sorted(options)) or "(defaults)"
        raise ValueError(f"redis_url TLS option(s) {names}: {exc}") from exc


def ignore_channel(channel: str) -> None:
    pass


class PubSubBackend(Protocol):
    immediate: bool
    """True when (un)subscribe only writes to a socket buffer: no batching needed."""

    async def run(
        self,
        on_message: OnMessage,
        on_reconnect: Callable[[], None],
        on_subscribed: OnSubscribed = ignore_channel,
    ) -> None:
        """Receive until closed. `on_reconnect` runs whenever messages may have been missed
        (a new connection is subscribed): streams then re-read their event logs.
        `on_subscribed` runs when Redis has confirmed a channel's SUBSCRIBE: every message
        published to it from then on arrives."""
        ...

    async def subscribe(self, *channels: str) -> None: ...

    async def unsubscribe(self, *channels: str) -> None: ...

    async def close(self) -> None: ...


def _pack(*parts: str) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


_PING = _pack("PING")


class RawPubSub(asyncio.Protocol):
    """One Redis connection in subscribed mode; reconnects and resubscribes by itself.

    A connection is ready once its first PONG arrives: Redis answers in order, so by then
    AUTH and SUBSCRIBE have been accepted. An error reply (NOAUTH, WRONGPASS, NOPERM, ...)
    drops the connection; one that never became ready is made again after a backoff.
    """

    immediate = True

    def __init__(
        self,
        target: Endpoint | Target,
        name: str = "genq-gateway",
        *,
        ping_interval_s: float = PING_INTERVAL_S,
        pong_timeout_s: float = PONG_TIMEOUT_S,
        sharded: bool = False,
        on_trouble: Callable[[], None] | None = None,
    ) -> None:
        """`sharded`: Redis Cluster shard channels (SSUBSCRIBE, one command per channel:
        a command's channels must share a slot); `on_trouble`: called when this node may no
        longer serve its channels (a refusal such as MOVED, a lost connection, a channel
        unsubscribed by the server because its slot moved): gateway/pubsub_cluster.py."""
        self._sharded = sharded
        self._on_trouble = on_trouble or (lambda: None)
        self.target: Target = Fixed(target) if isinstance(target, Endpoint) else target
        self.endpoint = target if isinstance(target, Endpoint) else None
        """The endpoint of the current (or last) connection."""
        client_name = self.endpoint.client_name if self.endpoint is not None else None
        self.name = client_name or name
        self._ping_interval_s = ping_interval_s
        self._pong_timeout_s = pong_timeout_s
        self._channels: set[str] = set()
        self._transport: asyncio.Transport | None = None
        self._outbox: list[bytes] = []
        self._reader = hiredis.Reader(encoding="utf-8", errors="replace")
        self._lost: asyncio.Future[None] | None = None
        self._on_message: OnMessage = lambda c, d: None
        self._on_ready: Callable[[], None] = lambda: None
        self._on_subscribed: OnSubscribed = ignore_channel
        self._unconfirmed: dict[str, int] = {}
        """SUBSCRIBEs of each channel sent on this connection and not yet confirmed: only the
        last one's reply confirms a channel unsubscribed and subscribed again meanwhile."""
        self._ready = False
        self._dropped = False
        self._heard = False
        """Something arrived since the last PING."""
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @classmethod
    def from_url(cls, url: str, connect_timeout_s: float, name: str = "genq-gateway") -> RawPubSub:
        return cls(Endpoint.from_url(url, connect_timeout_s), name)

    async def run(
        self,
        on_message: OnMessage,
        on_reconnect: Callable[[], None],
        on_subscribed: OnSubscribed = ignore_channel,
    ) -> None:
        self._on_message, self._on_ready = on_message, on_reconnect
        self._on_subscribed = on_subscribed
        loop = asyncio.get_running_loop()
        backoff = _BACKOFF_START_S
        failed = 0  # connects failed in a row: the first is a warning, the rest debug
        while not self._closed:
            # Made here, not in connection_made: uvloop calls that only after
            # create_connection has returned.
            lost: asyncio.Future[None] = loop.create_future()
            self._lost, self._ready = lost, False
            try:
                self.endpoint = await self.target.locate()
                await self.endpoint.connect(lambda: self)
            except (OSError, TimeoutError) as exc:
                # A certificate refused is a misconfiguration, as a password refused is.
                level = logging.WARNING if failed == 0 else logging.DEBUG
                level = logging.ERROR if isinstance(exc, ssl.SSLError) else level
                log.log(level, "pub/sub connect failed; retrying", extra=self._fields(exc))
                failed += 1
            else:
                if self._closed and self._transport is not None:  # closed while connecting
                    self._transport.close()
                    return
                await lost
            if self._ready:  # it worked until now: make it again at once
                backoff, failed = _BACKOFF_START_S, 0
            elif not self._closed:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = cast(asyncio.Transport, transport)  # uvloop's transports are no asyncio.Transport
        self._transport, self._dropped = t, False
        self._reader = hiredis.Reader(encoding="utf-8", errors="replace")
        self._outbox = []  # superseded by the full SUBSCRIBE below
        auth = self.endpoint.auth if self.endpoint is not None else ()
        hello = [_pack("AUTH", *auth)] if auth else []
        hello.append(_pack("CLIENT", "SETNAME", self.name))  # visible in CLIENT LIST
        self._unconfirmed = dict.fromkeys(self._channels, 1)
        if self._channels:
            hello.append(self._command("SUBSCRIBE", self._channels))
        t.write(b"".join(hello))
        self._ping()

    def data_received(self, data: bytes) -> None:
        self._heard = True
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                if isinstance(reply, list) and reply:
                    if reply[0] in ("message", "smessage"):
                        self._on_message(reply[1], reply[2])
                    elif reply[0] in ("subscribe", "ssubscribe"):
                        self._confirmed(reply[1])
                    elif reply[0] == "sunsubscribe" and reply[1] in self._channels:
                        self._on_trouble()  # the server let go of it: its slot moved
                    elif reply[0] == "pong":  # PONG in subscribed mode
                        self._ponged()
                elif isinstance(reply, hiredis.ReplyError):
                    self._refused(str(reply))
                    return
                elif reply == "PONG":  # no channel subscribed: not in subscribed mode
                    self._ponged()
        except hiredis.ProtocolError as exc:
            self._refused(f"unreadable reply: {exc}")

    def _confirmed(self, channel: str) -> None:
        left = self._unconfirmed.get(channel, 0) - 1
        if left > 0:
            self._unconfirmed[channel] = left
            return
        self._unconfirmed.pop(channel, None)
        if left == 0 and channel in self._channels:
            self._on_subscribed(channel)

    def _ping(self) -> None:
        if self._transport is None:
            return
        self._heard = False
        self._transport.write(_PING)
        self._timer = asyncio.get_running_loop().call_later(
            self._pong_timeout_s, self._pong_overdue
        )

    def _ponged(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._ping_interval_s, self._ping)
        if not self._ready:
            self._ready = True
            self._on_ready()  # subscribed from now on: what came before, the logs hold

    def _pong_overdue(self) -> None:
        if self._heard:  # replies are still arriving: the PONG is queued behind them
            self._heard = False
            self._timer = asyncio.get_running_loop().call_later(
                self._pong_timeout_s, self._pong_overdue
            )
            return
        log.warning(
            "pub/sub: no reply to PING; reconnecting",
            extra={**self._fields(), "pong_timeout_s": self._pong_timeout_s},
        )
        self._drop()

    def _refused(self, error: str) -> None:
        if self._sharded and error.startswith(("MOVED", "CLUSTERDOWN", "TRYAGAIN")):
            log.info("pub/sub: a slot moved; following it", extra=self._fields(error))
        else:
            log.error(
                "pub/sub: Redis refused the connection; reconnecting", extra=self._fields(error)
            )
        self._drop()
        self._on_trouble()

    def _drop(self) -> None:
        """Abort, not close: a half-open connection would never flush what is buffered."""
        self._dropped = True
        if self._transport is not None:
            self._transport.abort()

    def _fields(self, error: object = None) -> dict[str, object]:
        fields: dict[str, object] = {"redis": self.target.where, "client_name": self.name}
        if self.endpoint is not None and self.endpoint.username:
            fields["redis_user"] = self.endpoint.username
        if error is not None:
            fields["error"] = str(error)
        return fields

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        if not self._closed and not self._dropped:
            log.warning("pub/sub connection lost; reconnecting", extra=self._fields(exc))
        if not self._closed:
            self._on_trouble()

    async def subscribe(self, *channels: str) -> None:
        """Written at once: the caller queues its job next and wants to be listening first."""
        self._channels.update(channels)
        if self._transport is not None:
            for c in channels:
                self._unconfirmed[c] = self._unconfirmed.get(c, 0) + 1
            self._outbox.append(self._command("SUBSCRIBE", channels))
            self._write_out()

    async def unsubscribe(self, *channels: str) -> None:
        self._channels.difference_update(channels)
        self._queue(self._command("UNSUBSCRIBE", channels))

    @property
    def channels(self) -> set[str]:
        return self._channels

    def _command(self, verb: str, channels: Iterable[str]) -> bytes:
        """(UN)SUBSCRIBE of `channels`; sharded: S(UN)SUBSCRIBE, one command a channel."""
        if self._sharded:
            return b"".join(_pack(f"S{verb}", c) for c in channels)
        return _pack(verb, *channels)

    def _queue(self, command: bytes) -> None:
        """Write at the end of this loop iteration: one syscall for every stream that ended
        in it."""
        if self._transport is None:
            return  # sent with the whole channel set on (re)connect
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._write_out)
        self._outbox.append(command)

    def _write_out(self) -> None:
        data, self._outbox = b"".join(self._outbox), []
        if self._transport is not None and data:
            self._transport.write(data)

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._transport is not None:
            self._transport.close()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)


class RedisPyPubSub:
    """redis-py's PubSub behind the same interface (fakeredis, tests)."""

    immediate = False

    def __init__(self, redis: aioredis.Redis) -> None:
        self._pubsub = redis.pubsub()
        self._channels: set[str] = set()
        self._has_channels = asyncio.Event()
        self._closed = False

    async def run(
        self,
        on_message: OnMessage,
        on_reconnect: Callable[[], None],
        on_subscribed: OnSubscribed = ignore_channel,
    ) -> None:
        backoff = _BACKOFF_START_S
        while not self._closed:
            await self._has_channels.wait()
            try:
                while not self._closed:
                    # A timeout, not a blocking read: some clients swallow a cancel while
                    # blocked, and the loop must notice `close()`.
                    msg = await self._pubsub.get_message(timeout=_POLL_S)
                    if msg is None:
                        pass
                    elif msg["type"] == "message":
                        on_message(msg["channel"], msg["data"])
                    elif msg["type"] == "subscribe" and msg["channel"] in self._channels:
                        on_subscribed(msg["channel"])
                    backoff = _BACKOFF_START_S
            except (RedisError, OSError, RuntimeError) as exc:
                if self._closed:
                    return
                log.warning("pub/sub receive failed; reconnecting", extra={"error": str(exc)})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.aclose()
                    if self._channels:
                        await self._pubsub.subscribe(*self._channels)
                on_reconnect()

    async def subscribe(self, *channels: str) -> None:
        self._channels.update(channels)
        await self._pubsub.subscribe(*channels)
        self._has_channels.set()

    async def unsubscribe(self, *channels: str) -> None:
        self._channels.difference_update(channels)
        await self._pubsub.unsubscribe(*channels)

    async def close(self) -> None:
        self._closed = True
        self._has_channels.set()
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()
