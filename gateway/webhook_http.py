"""Where a webhook may go, and the HTTP/1.1 client that takes it there.

`Guard` holds the SSRF rules: https only (http where GENQ_WEBHOOK_ALLOW_HTTP), the host
resolved here and every address it resolves to checked (no loopback, private, link-local —
the metadata address among them —, multicast or reserved one, unless GENQ_WEBHOOK_ALLOW_HOSTS
names the host or a network holding the address).

`WebhookClient` posts an event over a connection opened to the checked address itself (the
address `Guard.resolve` returned, taken as a numeric address, never looked up again; TLS
verifies the certificate against the URL's host name, sent as SNI), so a name that resolves
differently a moment later (DNS rebinding) reaches nothing unchecked. A connection is kept
alive for the next event to the same scheme, host and port (it goes to an address checked
when it was opened); one the receiver closed while idle is opened again once. A redirect is
an answer like any other (its status; never followed); an answer's body is read up to
GENQ_WEBHOOK_MAX_RESPONSE_BYTES, and a connection whose answer was cut there is closed.

The client is made for one request shape, a small POST, at the rate a gateway ends jobs: with
httpx's general request path a delivery cost the gateway about 3 ms of CPU on the 2-core box,
with this one about 0.13 ms all told (docs/performance.md); llhttp (httptools, which uvicorn
parses with) reads the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import quote, urlsplit

import httptools
import httpx

from shared.settings import GatewaySettings
from shared.webhooks import is_public

KEEPALIVE_S = 5.0
"""How long an idle connection is kept for the next event (httpx's default; most servers
keep one at least this long)."""
MAX_HEAD_BYTES = 65_536
"""Most of an answer's status line and headers read (h11's limit)."""
_TARGET_SAFE = "!#$%&'()*+,/:;=?@[]~"
"""What a request target keeps as written; the rest (controls, spaces, non-ASCII) is
percent-encoded, so a URL cannot add a line to the request."""
_ORIGINS_CACHED = 1024
"""URLs whose checked parts are kept (the deployment's endpoints and recent job webhooks)."""


class Refused(Exception):
    """A URL or address a webhook may not reach; the message says why."""


class AnswerError(Exception):
    """A connection that ended, or an answer that broke HTTP/1.1, before a status came."""


class _Stale(AnswerError):
    """A kept-alive connection the receiver had closed: nothing of an answer came back."""


@dataclass(frozen=True)
class Target:
    """A URL checked, with the address it will be sent to."""

    url: str
    host: str
    address: str
    port: int
    scheme: str
    family: int = socket.AF_INET


class Guard:
    """The SSRF rules of GENQ_WEBHOOK_ALLOW_HTTP and GENQ_WEBHOOK_ALLOW_HOSTS."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.allow_http = settings.webhook_allow_http
        self.hosts: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in settings.webhook_allow_hosts:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.hosts.add(entry.lower().rstrip("."))

    def check_url(self, url: str) -> tuple[str, str, int]:
        """(scheme, host, port) of a URL a webhook may name; Refused otherwise. An address
        written in the URL is checked here too; a host name, when it is resolved."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("https", "http") or (scheme == "http" and not self.allow_http):
            raise Refused("webhook URLs are https (GENQ_WEBHOOK_ALLOW_HTTP allows http)")
        if parts.username or parts.password:
            raise Refused("a webhook URL carries no user or password")
        host = (parts.hostname or "").lower().rstrip(".")
        if not host:
            raise Refused("a webhook URL names a host")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise Refused("the webhook URL's port is not a number from 1 to 65535") from None
        with contextlib.suppress(ValueError):
            self.check_address(host, str(ipaddress.ip_address(host)))
        return scheme, host, port

    def check_address(self, host: str, address: str) -> None:
        if host in self.hosts:
            return
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if any(ip in n for n in self.networks):
            return
        if not is_public(address):
            raise Refused(
                f"{host} is {address}, a loopback, private, link-local or reserved address "
                "(GENQ_WEBHOOK_ALLOW_HOSTS opens one)"
            )

    async def resolve(self, url: str) -> Target:
        """The URL checked and resolved, every address it resolves to checked."""
        scheme, host, port = self.check_url(url)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise Refused(f"{host} does not resolve: {exc}") from None
        if not infos:
            raise Refused(f"{host} has no address")
        for info in infos:  # all of them: any could be the one used
            self.check_address(host, str(info[4][0]))
        family, _, _, _, sockaddr = infos[0]
        address = str(sockaddr[0])
        if len(sockaddr) == 4 and sockaddr[3]:  # IPv6: a link-local address's interface
            address = f"{address}%{sockaddr[3]}"
        return Target(url, host, address, port, scheme, family)


@dataclass(frozen=True)
class _Origin:
    """What a URL's requests share: the pool they draw on, and their request's first lines."""

    url: str
    scheme: str
    host: str
    port: int
    head: bytes
    """`POST <target> HTTP/1.1` and the Host header, each line ended."""

    @property
    def key(self) -> tuple[str, str, int]:
        return self.scheme, self.host, self.port


def _origin(guard: Guard, url: str) -> _Origin:
    scheme, host, port = guard.check_url(url)
    parts = urlsplit(url)
    target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), _TARGET_SAFE)
    try:
        name = host.encode("idna").decode("ascii")
    except UnicodeError:
        raise Refused(f"{host!r} is no host name") from None
    if ":" in name:  # an IPv6 address
        name = f"[{name}]"
    if port != (443 if scheme == "https" else 80):
        name = f"{name}:{port}"
    head = f"POST {target} HTTP/1.1\r\nhost: {name}\r\n".encode("ascii")
    return _Origin(url, scheme, host, port, head)


class _Connection(asyncio.Protocol):
    """One connection and its answers, parsed by llhttp as they arrive."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[int] | None = None
        self.status = 0
        self.head = 0  # bytes of the status line and headers
        self.body = 0
        self.heard = False  # a byte of this request's answer arrived
        self.lost = False
        self.reusable = True
        self.idle_since = 0.0

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None or answer.done():  # nothing was asked: the connection is not sound
            self.close()
            return
        self.heard = True
        if not self.status:
            self.head += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # 101: no HTTP/1.1 answer follows on it
            self.status = self.status or self.parser.get_status_code()
            self._settle(reuse=False)
        except httptools.HttpParserError as exc:
            self._fail(AnswerError(f"the answer is not HTTP/1.1: {exc}"))
        if not answer.done() and not self.status and self.head > MAX_HEAD_BYTES:
            self._fail(AnswerError(f"the answer's head is over {MAX_HEAD_BYTES} bytes"))

    def eof_received(self) -> bool:
        return False  # close: an answer read to its end was read in full

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost, self.reusable = True, False
        answer = self.answer
        if answer is None or answer.done():
            return
        if self.status:  # an answer without a length ends with its connection
            answer.set_result(self.status)
        elif self.heard:
            answer.set_exception(AnswerError("the connection closed mid-answer"))
        else:
            answer.set_exception(_Stale("the connection closed before an answer"))

    # -- llhttp's callbacks
    def on_message_begin(self) -> None:
        if self.answer is None or self.answer.done():  # a second answer to one request
            self.close()

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status >= 200 and not self.status:  # 1xx: an interim answer, the real one follows
            self.status = status

    def on_body(self, body: bytes) -> None:
        self.body += len(body)
        if self.body >= self.limit:  # the rest of an answer is never read
            self._settle(reuse=False)

    def on_message_complete(self) -> None:
        if self.status:
            self._settle(reuse=self.parser.should_keep_alive())

    # -- the request
    async def post(self, data: bytes, deadline: float) -> int:
        """The status of the answer to the request `data`, by `deadline` (the loop's time)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.answer = loop.create_future()
        self.status = self.head = self.body = 0
        self.heard = False
        timer = loop.call_at(deadline, self._time_out)
        self.transport.write(data)
        try:
            return await self.answer
        except BaseException:
            self.close()  # cancelled or failed: whatever comes later is no answer
            raise
        finally:
            timer.cancel()

    def _time_out(self) -> None:
        self._fail(TimeoutError("no answer within GENQ_WEBHOOK_TIMEOUT_S"))

    def _settle(self, reuse: bool) -> None:
        if self.answer is not None and not self.answer.done():
            self.reusable = self.reusable and reuse
            self.answer.set_result(self.status)
            if not self.reusable:
                self.close()

    def _fail(self, exc: Exception) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class WebhookClient:
    """Posts webhook events to checked addresses over kept-alive HTTP/1.1 connections."""

    def __init__(
        self,
        guard: Guard,
        max_response_bytes: int,
        max_idle: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.guard = guard
        self.limit = max_response_bytes
        self.max_idle = max_idle
        self.tls = tls
        self.idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self.opened = 0
        """Connections opened (a figure for tests and benchmarks)."""
        self._origins: dict[str, _Origin] = {}
        self._swept = time.monotonic()

    async def post(
        self, url: str, headers: Iterable[tuple[str, str]], body: bytes, deadline: float
    ) -> int:
        """The status of the receiver's answer to `body` posted to `url` with `headers`
        (besides Host and Content-Length), by `deadline` (the loop's time); Refused for a URL
        or address it may not reach; AnswerError or OSError (TimeoutError among them) for a
        connection that gave no answer."""
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) >= _ORIGINS_CACHED:
                self._origins.clear()
            origin = self._origins[url] = _origin(self.guard, url)
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers)
        data = b"".join((origin.head, f"{lines}content-length: {len(body)}\r\n\r\n".encode(), body))
        status: int | None = None
        conn = self._take(origin.key)
        if conn is not None:
            with contextlib.suppress(_Stale):  # closed by the receiver while idle: once more
                status = await conn.post(data, deadline)
        if conn is None or status is None:
            async with asyncio.timeout_at(deadline):
                conn = await self._open(origin)
            try:
                status = await conn.post(data, deadline)
            except _Stale as exc:
                raise AnswerError(str(exc)) from None
        self._give_back(origin.key, conn)
        return status

    async def _open(self, origin: _Origin) -> _Connection:
        target = await self.guard.resolve(origin.url)
        https = origin.scheme == "https"
        transport, conn = await asyncio.get_running_loop().create_connection(
            lambda: _Connection(self.limit),
            target.address,  # the address checked, taken as written: never looked up again
            target.port,
            family=target.family,
            flags=socket.AI_NUMERICHOST,
            ssl=self._tls() if https else None,
            server_hostname=origin.host if https else None,
        )
        conn.transport = transport  # uvloop may call connection_made only later
        self.opened += 1
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self.tls is None:  # the trust httpx gives (certifi's roots), the host name checked
            self.tls = httpx.create_ssl_context(trust_env=False)
            self.tls.set_alpn_protocols(["http/1.1"])
        return self.tls

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        now = time.monotonic()
        if now - self._swept > KEEPALIVE_S:
            self._sweep(now)
        idle = self.idle.get(key)
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if conn.reusable and transport is not None and not transport.is_closing():
                if now - conn.idle_since < KEEPALIVE_S:
                    return conn
            conn.close()
        return None

    def _give_back(self, key: tuple[str, str, int], conn: _Connection) -> None:
        conn.answer = None
        if not conn.reusable or sum(map(len, self.idle.values())) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.setdefault(key, []).append(conn)

    def _sweep(self, now: float) -> None:
        """Close what stayed idle too long (an endpoint not sent to again)."""
        self._swept = now
        for key, idle in list(self.idle.items()):
            keep = [c for c in idle if c.reusable and now - c.idle_since < KEEPALIVE_S]
            for c in idle:
                if c not in keep:
                    c.close()
            if keep:
                self.idle[key] = keep
            else:
                del self.idle[key]

    def close(self) -> None:
        for idle in self.idle.values():
            for conn in idle:
                conn.close()
        self.idle.clear()
