"""The webhook HTTP/1.1 client (gateway/webhook_http.py) against loopback servers whose answers
are scripted byte for byte: connections kept alive and reused, one the receiver closed while
idle opened again, answers of every framing (content-length, chunked, until close, interim
1xx) read to their end, a huge 2xx cut at the limit, a redirect returned and not followed,
the deadline kept, a broken answer refused; TLS verified against the URL's host name (sent as
SNI) on a connection to the address the guard checked."""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.webhook_http import AnswerError, Guard, Refused, Target, WebhookClient
from shared.settings import GatewaySettings
from tests.integration.test_pubsub_wire import make_certs

LIMIT = 65_536
BODY = b'{"id":"evt_1","object":"event","type":"job.succeeded"}'
HEADERS = [("content-type", "application/json"), ("webhook-id", "evt_1")]
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
DEADLINE_S = 5.0


@dataclass
class Then:
    """An answer, and whether the server closes the connection after it."""

    data: bytes
    close: bool = False


CLOSE = Then(b"", close=True)
"""Close the connection without answering."""
Writer = Callable[[asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Receiver:
    """A loopback server: each request gets the next of `answers` (then OK)."""

    answers: list[Then | Writer] = field(default_factory=list)
    requests: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    """(connection number, head, body) of every request read."""
    connections: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.connections += 1
        n = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"\r\ncontent-length: (\d+)\r\n", head, re.IGNORECASE)
                assert length is not None, head
                body = await reader.readexactly(int(length[1]))
                self.requests.append((n, head, body))
                answer = self.answers.pop(0) if self.answers else Then(OK)
                if isinstance(answer, Then):
                    writer.write(answer.data)
                    await writer.drain()
                    if answer.close:
                        break
                else:
                    await answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went
        finally:
            writer.close()
            self.tasks.discard(task)


@dataclass
class Served:
    receiver: Receiver
    url: str
    port: int


async def serve(receiver: Receiver, tls: ssl.SSLContext | None = None) -> asyncio.Server:
    return await asyncio.start_server(receiver.handle, "127.0.0.1", 0, ssl=tls)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    receiver = Receiver()
    server = await serve(receiver)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Served(receiver, f"http://127.0.0.1:{port}/hook?a=1", port)
    finally:
        server.close()
        for task in list(receiver.tasks):
            task.cancel()
        await asyncio.gather(*receiver.tasks, return_exceptions=True)


def guard(**more: object) -> Guard:
    settings = {"webhook_allow_http": True, "webhook_allow_hosts": ["127.0.0.1"], **more}
    return Guard(GatewaySettings(**settings))


@pytest.fixture
async def client() -> AsyncIterator[WebhookClient]:
    c = WebhookClient(guard(), LIMIT, max_idle=4)
    try:
        yield c
    finally:
        c.close()
        await asyncio.sleep(0)  # the transports' close callbacks run


def deadline(s: float = DEADLINE_S) -> float:
    return asyncio.get_running_loop().time() + s


async def post(client: WebhookClient, url: str) -> int:
    return await client.post(url, HEADERS, BODY, deadline())


async def test_connections_are_kept_alive_and_reused(served: Served, client: WebhookClient) -> None:
    statuses = [await post(client, served.url) for _ in range(5)]
    assert statuses == [200] * 5
    assert client.opened == 1 and served.receiver.connections == 1
    _, head, body = served.receiver.requests[0]
    assert head.startswith(b"POST /hook?a=1 HTTP/1.1\r\n")
    assert f"\r\nhost: 127.0.0.1:{served.port}\r\n".encode() in head
    assert b"\r\nwebhook-id: evt_1\r\n" in head and body == BODY


async def test_concurrent_posts_use_a_connection_each_and_keep_them(
    served: Served, client: WebhookClient
) -> None:
    for _ in range(3):
        statuses = await asyncio.gather(*(post(client, served.url) for _ in range(4)))
        assert statuses == [200] * 4
    assert client.opened == 4 and served.receiver.connections == 4


async def test_a_connection_the_receiver_closed_while_idle_is_opened_again(
    served: Served, client: WebhookClient
) -> None:
    """The race of a kept-alive connection: the receiver closes it as the next request goes
    out (nothing answered). The request goes again, once, on a new connection."""
    served.receiver.answers = [Then(OK), CLOSE]
    assert await post(client, served.url) == 200
    assert await post(client, served.url) == 200
    conns = [n for n, _, _ in served.receiver.requests]
    assert conns == [1, 1, 2] and client.opened == 2


async def test_a_connection_closed_after_its_answer_is_not_reused(
    served: Served, client: WebhookClient
) -> None:
    served.receiver.answers = [Then(OK, close=True)]
    assert await post(client, served.url) == 200
    await asyncio.sleep(0.05)  # the close has arrived
    assert await post(client, served.url) == 200
    assert [n for n, _, _ in served.receiver.requests] == [1, 2]


async def test_a_new_connection_closed_without_an_answer_is_a_failure_not_a_loop(
    served: Served, client: WebhookClient
) -> None:
    served.receiver.answers = [CLOSE, CLOSE, CLOSE]
    with pytest.raises(AnswerError):
        await post(client, served.url)
    assert len(served.receiver.requests) == 1


async def test_chunked_and_content_length_answers_are_read_to_their_end(
    served: Served, client: WebhookClient
) -> None:
    chunked = b"HTTP/1.1 202 Accepted\r\ntransfer-encoding: chunked\r\n\r\n"
    chunked += b"5\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n"
    served.receiver.answers = [
        Then(chunked),
        Then(b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nhello"),
        Then(b"HTTP/1.1 204 No Content\r\n\r\n"),
        Then(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
        Then(chunked),
    ]
    statuses = [await post(client, served.url) for _ in range(5)]
    assert statuses == [202, 201, 204, 200, 202]
    assert client.opened == 1  # each answer's end found: the next went on the same connection


async def test_an_answer_without_a_length_ends_with_its_connection(
    served: Served, client: WebhookClient
) -> None:
    served.receiver.answers = [
        Then(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end", close=True),
        Then(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n"),  # 1.0: not kept alive
    ]
    assert await post(client, served.url) == 200
    assert await post(client, served.url) == 200
    assert await post(client, served.url) == 200
    assert [n for n, _, _ in served.receiver.requests] == [1, 2, 3]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_huge_2xx_answer_is_read_only_up_to_the_limit(
    served: Served, client: WebhookClient, framing: str
) -> None:
    sent = 0

    async def huge(writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        length = b"content-length: 104857600" if framing == "content-length" else b""
        chunked = b"transfer-encoding: chunked" if framing == "chunked" else b""
        writer.write(b"HTTP/1.1 200 OK\r\n" + length + chunked + b"\r\n\r\n")
        piece = b"x" * LIMIT
        if framing == "chunked":
            piece = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        for _ in range(1600):  # 100 MB
            writer.write(piece)
            await writer.drain()  # raises once the client has closed
            sent += len(piece)

    served.receiver.answers = [huge]
    t0 = time.monotonic()
    assert await post(client, served.url) == 200
    assert time.monotonic() - t0 < 2
    assert await post(client, served.url) == 200  # the cut connection was not kept
    assert client.opened == 2
    assert sent < 20 * 2**20


async def test_a_redirect_is_an_answer_not_followed(served: Served, client: WebhookClient) -> None:
    served.receiver.answers = [
        Then(
            b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://169.254.169.254/\r\n"
            b"content-length: 0\r\n\r\n"
        )
    ]
    assert await post(client, served.url) == 307
    assert len(served.receiver.requests) == 1


async def test_no_answer_by_the_deadline_is_a_timeout_and_the_connection_goes(
    served: Served, client: WebhookClient
) -> None:
    async def never(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(60)

    served.receiver.answers = [never]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await client.post(served.url, HEADERS, BODY, deadline(0.3))
    assert 0.25 < time.monotonic() - t0 < 2
    assert await post(client, served.url) == 200
    assert client.opened == 2


@pytest.mark.parametrize(
    "answer",
    [b"SSH-2.0-OpenSSH_9.6\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"],
    ids=["not-http", "bad-length"],
)
async def test_an_answer_that_is_not_http_is_refused(
    served: Served, client: WebhookClient, answer: bytes
) -> None:
    served.receiver.answers = [Then(answer)]
    with pytest.raises(AnswerError):
        await post(client, served.url)
    assert await post(client, served.url) == 200
    assert client.opened == 2


async def test_a_head_without_end_is_cut(served: Served, client: WebhookClient) -> None:
    served.receiver.answers = [Then(b"HTTP/1.1 200 OK\r\n" + b"x-pad: 0123456789abcdef\r\n" * 8000)]
    with pytest.raises(AnswerError, match="head"):
        await post(client, served.url)


async def test_a_url_cannot_add_a_line_to_the_request(
    served: Served, client: WebhookClient
) -> None:
    url = f"http://127.0.0.1:{served.port}/a\x7fb\u00e9?q=x\x00y"
    assert await post(client, url) == 200
    _, head, _ = served.receiver.requests[0]
    assert head.startswith(b"POST /a%7Fb%C3%A9?q=x%00y HTTP/1.1\r\n")


async def test_a_private_address_is_refused_before_any_connection(served: Served) -> None:
    closed = WebhookClient(guard(webhook_allow_hosts=[]), LIMIT, max_idle=4)
    with pytest.raises(Refused):
        await post(closed, served.url)
    assert closed.opened == 0 and served.receiver.connections == 0


class Pinned(Guard):
    """A resolver that answers `name` with the loopback address (as a public DNS name whose
    record pointed there would): the client must connect to what this returned."""

    def __init__(self, name: str, settings: GatewaySettings) -> None:
        super().__init__(settings)
        self.name = name
        self.resolved = 0

    async def resolve(self, url: str) -> Target:
        scheme, host, port = self.check_url(url)
        assert host == self.name
        self.resolved += 1
        return Target(url, host, "127.0.0.1", port, scheme)


async def test_the_connection_goes_to_the_checked_address_and_no_other(served: Served) -> None:
    """`hook.invalid` resolves nowhere: only the guard's answer can have been connected to."""
    pinned = Pinned("hook.invalid", GatewaySettings(webhook_allow_http=True))
    c = WebhookClient(pinned, LIMIT, max_idle=4)
    try:
        url = f"http://hook.invalid:{served.port}/x"
        assert [await post(c, url) for _ in range(3)] == [200] * 3
    finally:
        c.close()
    _, head, _ = served.receiver.requests[0]
    assert f"\r\nhost: hook.invalid:{served.port}\r\n".encode() in head
    assert pinned.resolved == 1  # then the kept-alive connection to that address


@pytest.mark.parametrize(("name", "verified"), [("localhost", True), ("hook.invalid", False)])
async def test_tls_verifies_the_certificate_against_the_urls_host_sent_as_sni(
    tmp_path: Path, name: str, verified: bool
) -> None:
    """The server's certificate names localhost and 127.0.0.1; the connection goes to
    127.0.0.1 either way, and holds only where the URL's host is one the certificate names."""
    certs = make_certs(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(certs.server_cert, certs.server_key)
    sni: list[str | None] = []

    def heard(sock: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        sni.append(server_name)

    server_tls.sni_callback = heard
    receiver = Receiver()
    server = await serve(receiver, server_tls)
    port = server.sockets[0].getsockname()[1]
    trust = ssl.create_default_context(cafile=str(certs.ca))
    c = WebhookClient(Pinned(name, GatewaySettings()), LIMIT, max_idle=4, tls=trust)
    try:
        url = f"https://{name}:{port}/hook"
        if verified:
            assert await post(c, url) == 200
            assert receiver.requests[0][1].startswith(b"POST /hook HTTP/1.1\r\n")
        else:
            with pytest.raises(ssl.SSLCertVerificationError):
                await post(c, url)
            assert receiver.requests == []
        assert sni == [name]
    finally:
        c.close()
        server.close()
        for task in list(receiver.tasks):
            task.cancel()
        await asyncio.gather(*receiver.tasks, return_exceptions=True)
