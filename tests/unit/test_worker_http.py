"""worker/http.py, the worker's small HTTP/1.1 server, over real sockets; and the worker's
probes answering while its model loads (serve_worker builds the engine beside the server)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from shared.settings import WorkerSettings
from tests.conftest import REDIS_URL, test_prefix
from tests.procs import free_port
from worker import http, process
from worker.engine import Engine
from worker.http import HttpServer, Response

LOAD_TIMEOUT_S = 10.0


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return reply


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    s = HttpServer("127.0.0.1", free_port())

    async def ok() -> Response:
        return Response(200, b"fine\n")

    async def broken() -> Response:
        raise RuntimeError("a bug")

    s.route("/ok", ok)
    s.route("/broken", broken)
    await s.start()
    yield s
    await s.close()


async def test_routes_answer_and_unknown_ones_are_404(server: HttpServer) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        r = await client.get("/ok?probe=1")
        assert (r.status_code, r.text, r.headers["connection"]) == (200, "fine\n", "close")
        r = await client.get("/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await client.head("/ok")
        assert r.status_code == 200 and r.headers["content-length"] == "5" and r.content == b""


async def test_only_get_and_head(server: HttpServer) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        r = await client.post("/ok", content=b"x")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
    assert r.json()["error"]["message"] == "POST not allowed: GET only"


async def test_bad_requests_get_4xx(server: HttpServer) -> None:
    assert (await _raw(server.port, b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
    huge = b"GET /ok HTTP/1.1\r\nX: " + b"a" * http.MAX_HEAD_BYTES + b"\r\n\r\n"
    assert (await _raw(server.port, huge)).startswith(b"HTTP/1.1 431 ")


async def test_a_broken_handler_answers_500_and_the_server_goes_on(server: HttpServer) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        assert (await client.get("/broken")).status_code == 500
        assert (await client.get("/ok")).status_code == 200


async def test_a_stalled_client_holds_nobody_up(
    server: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "READ_TIMEOUT_S", 0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /ok HTTP/1.1\r\n")  # and never the end of its head
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        assert (await client.get("/ok")).status_code == 200
    assert await asyncio.wait_for(reader.read(), 5) == b""  # dropped after the timeout
    writer.close()


async def test_a_slow_handler_answers_503(
    server: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "HANDLER_TIMEOUT_S", 0.1)

    async def slow() -> Response:
        await asyncio.sleep(10)
        return Response(200)

    server.route("/slow", slow)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        assert (await client.get("/slow")).status_code == 503


# ---- the worker's probes while its model loads -------------------------------------------


@pytest.fixture
def restore_switch_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


async def test_probes_answer_while_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, restore_switch_interval: None
) -> None:
    prefix = test_prefix()
    port = free_port()
    settings = WorkerSettings(
        redis_url=REDIS_URL,
        key_prefix=prefix,
        metrics_port=port,
        metrics_host="127.0.0.1",
        engine_process=False,  # the engine is built here, where the test can hold it up
    )
    loading, loaded = threading.Event(), threading.Event()
    real_build = process.build_engine

    def slow_build(s: WorkerSettings) -> Engine:
        loading.set()
        assert loaded.wait(LOAD_TIMEOUT_S), "the test never let the model load"
        return real_build(s)

    monkeypatch.setattr(process, "build_engine", slow_build)
    task = asyncio.create_task(process.serve_worker(settings))
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(loading.wait, LOAD_TIMEOUT_S)
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/healthz")).status_code == 200
            r = await client.get("/readyz")
            assert r.status_code == 503 and r.json()["reason"] == "loading model"
            loaded.set()
            async with asyncio.timeout(LOAD_TIMEOUT_S):
                while (await client.get("/readyz")).status_code != 200:
                    await asyncio.sleep(0.05)
    finally:
        loaded.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        r = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        keys = [k async for k in r.scan_iter(match=f"{prefix}*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()
