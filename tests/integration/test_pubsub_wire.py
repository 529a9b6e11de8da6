"""genq's raw pub/sub connection against private redis-servers: where a URL sends it (a unix
socket, TLS with the URL's certificates), what it does when Redis refuses it (an error logged,
retried with backoff), and how it notices a peer gone silent (PING, then reconnect)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.app import create_app
from gateway.pubsub_wire import PING_INTERVAL_S, PONG_TIMEOUT_S, RawPubSub
from shared.settings import GatewaySettings
from tests.conftest import test_prefix
from tests.procs import RedisServer, free_port

pytestmark = pytest.mark.contract  # redis-py's URL parsing and SSLConnection options

WIRE_LOGGER = "gateway.pubsub_wire"
SLACK_S = 3.0
"""Beyond the PING interval and PONG timeout: the wait for a loaded 2-core machine."""
STARTUP_S = 60.0
CONNECT_TIMEOUT_S = 5.0
RETRIED = 2
"""Errors logged before a test fixes the server: the connection did try again."""


@contextlib.contextmanager
def private_redis(*args: str) -> Iterator[RedisServer]:
    """A redis-server in a short temporary dir (a unix socket path has ~100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="genq-wire-") as tmp:
        server = RedisServer(Path(tmp), args=args)
        server.start()
        try:
            yield server
        finally:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)  # a stopped one still dies on SIGKILL
            server.kill()


@dataclass
class Receiver:
    """A RawPubSub running with callbacks that record what it delivered."""

    backend: RawPubSub
    messages: list[tuple[str, str]] = field(default_factory=list)
    readies: int = 0

    def on_message(self, channel: str, data: str) -> None:
        self.messages.append((channel, data))

    def on_ready(self) -> None:
        self.readies += 1

    def got(self, data: str) -> bool:
        return any(d == data for _, d in self.messages)


@contextlib.asynccontextmanager
async def receiving(url: str) -> AsyncIterator[Receiver]:
    backend = RawPubSub.from_url(url, CONNECT_TIMEOUT_S, f"genq-wire-{uuid.uuid4().hex}")
    rx = Receiver(backend)
    task = asyncio.create_task(backend.run(rx.on_message, rx.on_ready))
    try:
        yield rx
    finally:
        await backend.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout:.1f} s: {what}") from None


async def published_and_heard(admin: aioredis.Redis, rx: Receiver, channel: str) -> None:
    """Publish until the receiver has the message: SUBSCRIBE may still be on its way."""
    data = uuid.uuid4().hex
    async with asyncio.timeout(10):
        while not rx.got(data):
            await admin.publish(channel, data)
            await asyncio.sleep(0.05)


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == WIRE_LOGGER and r.levelno >= logging.ERROR]


def logged_text(caplog: pytest.LogCaptureFixture) -> str:
    """Every record's message and fields: what a log pipeline would see."""
    return "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)


async def test_a_unix_socket_url_connects_to_that_socket() -> None:
    with tempfile.TemporaryDirectory(prefix="genq-sock-") as sockdir:
        sock = f"{sockdir}/redis.sock"
        with private_redis("--unixsocket", sock, "--unixsocketperm", "700") as server:
            admin = aioredis.Redis(port=server.port, decode_responses=True)
            async with receiving(f"unix://{sock}") as rx:
                await rx.backend.subscribe("wire:unix")
                await published_and_heard(admin, rx, "wire:unix")
                [mine] = [c for c in await admin.client_list() if c["name"] == rx.backend.name]
                assert mine["addr"].startswith(sock)
            await admin.aclose()


async def test_a_wrong_password_is_an_error_retried_until_the_server_accepts_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=WIRE_LOGGER)
    right, wrong = f"right-{uuid.uuid4().hex}", f"wrong-{uuid.uuid4().hex}"
    with private_redis("--requirepass", right) as server:
        admin = aioredis.Redis(port=server.port, password=right, decode_responses=True)
        async with receiving(f"redis://:{wrong}@127.0.0.1:{server.port}") as rx:
            await rx.backend.subscribe("wire:auth")
            await until(lambda: len(errors(caplog)) >= RETRIED, 10, "WRONGPASS logged, retried")
            assert "WRONGPASS" in errors(caplog)[0].__dict__["error"]
            assert rx.readies == 0
            await admin.config_set("requirepass", wrong)  # the server now takes that password
            await published_and_heard(admin, rx, "wire:auth")
            assert rx.readies == 1
        await admin.aclose()
    assert right not in logged_text(caplog) and wrong not in logged_text(caplog)


async def test_an_acl_user_without_channel_rights_is_an_error_retried_until_granted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=WIRE_LOGGER)
    password = f"pw-{uuid.uuid4().hex}"
    with private_redis() as server:
        admin = aioredis.Redis(port=server.port, decode_responses=True)
        # No channel pattern: Redis 7 grants none by default, so SUBSCRIBE is refused.
        await admin.acl_setuser(
            "genq", enabled=True, passwords=[f"+{password}"], commands=["+@all"]
        )
        async with receiving(f"redis://genq:{password}@127.0.0.1:{server.port}") as rx:
            await rx.backend.subscribe("wire:acl")
            await until(lambda: len(errors(caplog)) >= RETRIED, 10, "NOPERM logged, retried")
            first = errors(caplog)[0].__dict__
            assert "NOPERM" in first["error"] and first["redis_user"] == "genq"
            await admin.acl_setuser("genq", enabled=True, channels=["wire:*"])
            await published_and_heard(admin, rx, "wire:acl")
        await admin.aclose()
    assert password not in logged_text(caplog)


async def test_a_silent_peer_is_noticed_by_ping_and_the_connection_made_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=WIRE_LOGGER)
    with private_redis() as server:
        assert server.proc is not None
        admin = aioredis.Redis(port=server.port, decode_responses=True)
        async with receiving(server.url) as rx:
            await rx.backend.subscribe("wire:ping")
            await published_and_heard(admin, rx, "wire:ping")
            [before] = [c["id"] for c in await admin.client_list() if c["name"] == rx.backend.name]
            readies = rx.readies
            # Stopped, Redis keeps its sockets open and answers nothing: a half-open peer.
            server.proc.send_signal(signal.SIGSTOP)
            try:
                await until(
                    lambda: any("PING" in r.getMessage() for r in caplog.records),
                    PING_INTERVAL_S + PONG_TIMEOUT_S + SLACK_S,
                    "the unanswered PING noticed",
                )
            finally:
                server.proc.send_signal(signal.SIGCONT)
            await until(lambda: rx.readies > readies, 10, "connected again")
            await published_and_heard(admin, rx, "wire:ping")
            async with asyncio.timeout(10):  # Redis drops the old one as it reads its RST
                while before in {c["id"] for c in await admin.client_list()}:
                    await asyncio.sleep(0.05)
        await admin.aclose()


@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_certs(d: Path) -> Certs:
    """A throwaway CA, and a server (127.0.0.1) and client certificate signed by it."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", d / "ca.key", "-out", d / "ca.crt", "-days", "1",
             "-subj", "/CN=genq-test-ca")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        _openssl("req", *ec, "-keyout", d / f"{who}.key", "-out", d / f"{who}.csr",
                 "-subj", f"/CN=genq-test-{who}")  # fmt: skip
        _openssl("x509", "-req", "-in", d / f"{who}.csr", "-CA", d / "ca.crt",
                 "-CAkey", d / "ca.key", "-CAcreateserial", "-out", d / f"{who}.crt",
                 "-days", "1", "-extfile", d / "san.ext")  # fmt: skip
    return Certs(
        d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key"
    )


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, int, Certs]]:
    """A redis-server with a TLS port that requires client certificates (and a plain port)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a throwaway CA with")
    certs = make_certs(tmp_path)
    tls_port = free_port()
    args = ("--tls-port", str(tls_port), "--tls-cert-file", str(certs.server_cert),
            "--tls-key-file", str(certs.server_key), "--tls-ca-cert-file", str(certs.ca),
            "--tls-auth-clients", "yes")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="genq-wire-") as tmp:
        server = RedisServer(Path(tmp), args=args)
        try:
            server.start()
        except TimeoutError:
            if server.proc is None or server.proc.poll() is None:
                raise
            reason = "this redis-server exits when given TLS options (built without TLS?)"
            print(reason)
            pytest.skip(reason)
        try:
            yield server, tls_port, certs
        finally:
            server.kill()


async def test_tls_uses_the_urls_certificates(tls_redis: tuple[RedisServer, int, Certs]) -> None:
    server, tls_port, certs = tls_redis
    admin = aioredis.Redis(port=server.port, decode_responses=True)
    url = (
        f"rediss://127.0.0.1:{tls_port}?ssl_ca_certs={certs.ca}"
        f"&ssl_certfile={certs.client_cert}&ssl_keyfile={certs.client_key}"
    )
    async with receiving(url) as rx:
        await rx.backend.subscribe("wire:tls")
        await published_and_heard(admin, rx, "wire:tls")
    await admin.aclose()


async def test_tls_refuses_a_server_its_ca_did_not_sign(
    tls_redis: tuple[RedisServer, int, Certs], caplog: pytest.LogCaptureFixture
) -> None:
    _, tls_port, certs = tls_redis
    caplog.set_level(logging.INFO, logger=WIRE_LOGGER)
    keys = f"ssl_certfile={certs.client_cert}&ssl_keyfile={certs.client_key}"
    url = f"rediss://127.0.0.1:{tls_port}?{keys}"  # no ssl_ca_certs: the system's CAs
    async with receiving(url) as rx:
        await until(
            lambda: any("CERTIFICATE_VERIFY_FAILED" in r.__dict__["error"] for r in errors(caplog)),
            10,
            "verification failed, logged as an error",
        )
        assert rx.readies == 0


def _settings(url: str) -> GatewaySettings:
    return GatewaySettings(redis_url=url, key_prefix=test_prefix())


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("redis://:sekrit@127.0.0.1:6379/0?foo=bar", "foo"),
        ("rediss://:sekrit@127.0.0.1:6379/0?ssl_cert_req=none", "ssl_cert_req"),  # a typo
        ("redis://:sekrit@127.0.0.1:6379/0?ssl_ca_certs=/etc/ssl/ca.pem", "rediss://"),
        ("rediss://:sekrit@127.0.0.1:6379/0?ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs"),
        ("rediss://:sekrit@127.0.0.1:6379/0?ssl_cert_reqs=sometimes", "ssl_cert_reqs"),
        ("unix://:sekrit@", "unix://"),
    ],
)
def test_the_app_refuses_a_url_option_the_connection_cannot_honour(query: str, named: str) -> None:
    with pytest.raises(ValueError, match="redis_url") as raised:
        create_app(_settings(query), raw_pubsub=True)
    assert named in str(raised.value) and "sekrit" not in str(raised.value)


def test_a_gateway_with_such_a_url_exits_before_serving(tmp_path: Path) -> None:
    """With several processes too: uvicorn would respawn each failing child forever."""
    run = subprocess.run(
        [sys.executable, "-m", "genq", "gateway", "--port", str(free_port()), "--workers", "2"],
        env={**os.environ, "GENQ_REDIS_URL": "redis://127.0.0.1:6379/0?foo=bar"},
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
    )
    assert run.returncode != 0 and "option(s) foo" in run.stderr
