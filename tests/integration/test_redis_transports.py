"""genq end to end over the ways the README says it reaches Redis besides plain TCP: a unix
socket (`unix://`) and mutual TLS (`rediss://` with the URL's certificates). Each
test starts a private redis-server listening on that transport only (`--port 0`: no plain TCP),
so the real `genq gateway` and `genq worker` can reach it no other way, and streams a job
through it.

redis-py takes different options for each transport (one passed to a connection class that
lacks it fails at the first command), so these are contract tests: `.ci/try-upgrades` runs
them against the newest releases the dependency bounds allow.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gateway.app import create_app
from shared.redisconn import connect
from shared.settings import GatewaySettings, RedisSettings
from tests.integration.test_pubsub_wire import make_certs
from tests.procs import free_port, quick_cluster, wait_for

pytestmark = [pytest.mark.contract, pytest.mark.e2e]

MAX_TOKENS = 8
STARTUP_S = 60.0
"""A gateway start, with its imports, on a loaded 2-core machine."""


@contextlib.contextmanager
def _redis_server(tmp: Path, client: redis.Redis, *args: str) -> Iterator[None]:
    """A private redis-server with `args` (its transport), up once `client` reaches it."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("needs redis-server on PATH")
    log = tmp / "redis.log"
    base = [exe, "--port", "0", "--dir", str(tmp), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*base, "--logfile", str(log), *args])
    try:
        deadline = time.monotonic() + 10
        while not _answers(client):
            if proc.poll() is not None or time.monotonic() > deadline:
                said = log.read_text(errors="replace") if log.exists() else ""
                if "--tls-port" in args and "TLS" in said and "support" in said:
                    pytest.skip(f"this redis-server was built without TLS: {said[-200:]}")
                pytest.fail(f"redis-server {' '.join(args)} did not come up: {said[-500:]}")
            time.sleep(0.02)
        yield
    finally:
        client.close()
        proc.kill()
        proc.wait()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


def _stream_a_job(redis_url: str, tmp: Path) -> None:
    """`genq gateway` and a sim `genq worker` on `redis_url`: a job streamed to its end."""
    with quick_cluster(redis_url, tmp, "transport") as cluster:
        # started together: their start-ups overlap
        worker = cluster.worker("--engine", "sim", "--step-ms", "1", wait_model=None)
        gw = cluster.gateway()
        wait_for(
            lambda: [m["id"] for m in httpx.get(f"{gw.url}/v1/models").json()["data"]] == ["sim"],
            what=f"the sim worker: {worker.output()[-500:]}",
        )
        body = {"model": "sim", "prompt": "hello", "max_tokens": MAX_TOKENS, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/jobs", json=body, timeout=30) as r:
            assert r.status_code == 200, r.read()
            job_id = r.headers["X-Job-Id"]
            frames = [f for f in r.read().decode().split("\n\n") if "data: " in f]
        types = [f.split("event: ", 1)[1].split("\n", 1)[0] for f in frames]
        assert types[-1] == "done", frames
        done = json.loads(frames[-1].split("data: ", 1)[1])
        assert done["usage"]["completion_tokens"] == MAX_TOKENS, done
        # the record, read back through the gateway's own pooled client
        job = httpx.get(f"{gw.url}/v1/jobs/{job_id}", timeout=10).json()
        assert job["status"] == "succeeded" and job["text"], job


def test_a_job_streams_end_to_end_over_a_unix_socket(tmp_path: Path) -> None:
    # a socket's path has ~100 bytes: a short directory, not pytest's long tmp_path
    with tempfile.TemporaryDirectory(prefix="genq-ux-") as short:
        sock = Path(short) / "redis.sock"
        client = redis.Redis(unix_socket_path=str(sock), socket_timeout=2)
        with _redis_server(tmp_path, client, "--unixsocket", str(sock), "--unixsocketperm", "700"):
            _stream_a_job(f"unix://{sock}?db=0", tmp_path)
            # the server's only way in is the socket: what genq wrote came through it
            assert client.dbsize() > 0


def test_a_job_streams_end_to_end_over_tls(tmp_path: Path) -> None:
    """Mutual TLS: the server checks the client's certificate, genq the server's."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a throwaway CA with")
    certs = make_certs(tmp_path)
    port = free_port()
    client = redis.Redis(
        port=port,
        ssl=True,
        ssl_ca_certs=str(certs.ca),
        ssl_certfile=str(certs.client_cert),
        ssl_keyfile=str(certs.client_key),
        socket_timeout=2,
    )
    tls = ["--tls-port", str(port), "--bind", "127.0.0.1", "--tls-auth-clients", "yes"]
    tls += ["--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key)]
    with _redis_server(tmp_path, client, *tls, "--tls-ca-cert-file", str(certs.ca)):
        _stream_a_job(
            f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs.ca}"
            f"&ssl_certfile={certs.client_cert}&ssl_keyfile={certs.client_key}",
            tmp_path,
        )
        assert client.dbsize() > 0


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("unix:///run/redis.sock?socket_keepalive=true", "socket_keepalive: TCP only"),
        ("redis://127.0.0.1:6379/0?ssl_ca_certs=/etc/ca.pem", "ssl_ca_certs: TLS only"),
        ("unix:///run/redis.sock?ssl_cert_reqs=none", "ssl_cert_reqs: TLS only"),
    ],
)
def test_an_option_the_urls_transport_lacks_is_refused_by_name(url: str, says: str) -> None:
    """Rather than handed to redis-py's connection, whose constructor fails at the first
    command (a worker would start and then fail every Redis call)."""
    with pytest.raises(ValueError, match=f"redis_url option {says}"):
        connect(RedisSettings(redis_url=url))


def test_the_options_a_transport_takes_pass() -> None:
    for url in (
        "unix:///run/redis.sock?db=2&socket_timeout=3",
        "rediss://127.0.0.1:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
        "redis://127.0.0.1:6379/0?socket_keepalive=true",
    ):
        connect(RedisSettings(redis_url=url))  # builds the pool; connects on the first command


def test_a_gateway_given_such_a_url_exits_before_serving(tmp_path: Path) -> None:
    """With several processes too: uvicorn would respawn each child failing its start."""
    url = "unix:///run/genq-test.sock?socket_keepalive=true"
    run = subprocess.run(
        [sys.executable, "-m", "genq", "gateway", "--port", str(free_port()), "--workers", "2"],
        env={**os.environ, "GENQ_REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
    )
    assert run.returncode != 0 and "redis_url option socket_keepalive: TCP only" in run.stderr


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_the_command_says_so_in_one_line(command: str) -> None:
    url = "redis://:sekrit@127.0.0.1:6379/0?ssl_ca_certs=/etc/ca.pem"
    run = subprocess.run(
        [sys.executable, "-m", "genq", command],
        env={**os.environ, "GENQ_REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
    )
    assert run.returncode != 0 and "sekrit" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "genq: error: GENQ_REDIS_URL: redis_url option ssl_ca_certs: TLS only, in a rediss:// URL"
    ]


def test_the_app_refuses_such_a_url_before_serving() -> None:
    """`create_app_from_env` (uvicorn's factory) too, not only the command line."""
    settings = GatewaySettings(redis_url="unix:///run/redis.sock?socket_keepalive=true")
    with pytest.raises(ValueError, match="redis_url option socket_keepalive: TCP only"):
        create_app(settings)
