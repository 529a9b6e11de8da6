"""`genq bench` against real `genq gateway` + `genq worker` processes: each route it measures,
TLS, and its progress bar on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL
from tests.prefixes import test_prefix
from tests.procs import Cluster, Proc, free_port

pytestmark = pytest.mark.e2e

REQUESTS, TOKENS = 16, 20
TERMINAL_ROWS, TERMINAL_COLUMNS = 24, 120
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A gateway that can render chat for the template-less sim model, and one sim worker."""
    c = Cluster(
        REDIS_URL,
        tmp_path_factory.mktemp("bench"),
        test_prefix("bench"),
        GENQ_DEFAULT_CHAT_TEMPLATE=CHAT_TEMPLATE,
    )
    try:
        gw = c.gateway()
        c.worker("--step-ms", "1")
        yield gw
    finally:
        c.close()


def bench(url: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "genq", "bench", "--url", url, "--concurrency", "8"]
    cmd += ["--requests", str(REQUESTS), "--max-tokens", str(TOKENS), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("api", ["native", "openai", "chat"])
def test_each_route_is_measured(gateway: Proc, api: str) -> None:
    out = bench(gateway.url, "--api", api, "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["api"] == api
    assert figures["completed"] == REQUESTS and figures["errors"] == 0, figures["first_error"]
    assert figures["tokens"] == REQUESTS * TOKENS  # the usage chunk's count on OpenAI routes
    assert figures["ttft_ms_p50"] > 0 and figures["itl_ms_p50"] > 0
    assert figures["ttft_ms_p99"] >= figures["ttft_ms_p50"]


def test_a_refused_route_counts_as_errors(gateway: Proc) -> None:
    cmd = [sys.executable, "-m", "genq", "bench", "--url", gateway.url, "--api", "chat"]
    cmd += ["--model", "no-such-model", "--requests", "2", "--concurrency", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    figures = json.loads(out.stdout)
    assert out.returncode == 1 and figures["errors"] == 2 and figures["completed"] == 0
    assert figures["first_error"].startswith("HTTP 404")


def test_other_url_schemes_are_refused_in_one_line() -> None:
    out = bench("ftp://127.0.0.1:1")
    assert out.returncode == 2 and not out.stdout
    assert out.stderr.strip().count("\n") == 0 and "http:// or https://" in out.stderr


# ---- TLS --------------------------------------------------------------------------------------

_PROXY = """
import asyncio, ssl, sys

port, upstream, cert, key = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)


async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except (OSError, ssl.SSLError):
        pass
    finally:
        w.close()


async def handle(cr, cw):
    ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
    await asyncio.gather(pipe(cr, uw), pipe(ur, cw))


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=ctx)
    print("ready", flush=True)
    await server.serve_forever()


asyncio.run(main())
"""


@pytest.fixture
def tls_url(gateway: Proc, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The gateway behind a TLS-terminating proxy with a self-signed certificate for
    127.0.0.1: (https URL, the certificate)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cmd = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    cmd += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
    subprocess.run(
        [*cmd, "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True
    )
    port = free_port()
    assert gateway.port is not None
    args = [str(port), str(gateway.port), str(cert), str(key)]
    proxy = subprocess.Popen(
        [sys.executable, "-c", _PROXY, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proxy.stdout is not None and proxy.stdout.readline().strip() == "ready"
        yield f"https://127.0.0.1:{port}", cert
    finally:
        proxy.kill()
        proxy.wait()
        if proxy.stdout is not None:
            proxy.stdout.close()


def test_https_urls_are_benchmarked_over_tls(tls_url: tuple[str, Path]) -> None:
    url, cert = tls_url
    out = bench(url, "--json", env={**os.environ, "SSL_CERT_FILE": str(cert)})
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["completed"] == REQUESTS and figures["tokens"] == REQUESTS * TOKENS
    assert figures["gateway_peak_rss_mb"] is not None  # /readyz came back over TLS too


def test_an_untrusted_certificate_fails_every_request(tls_url: tuple[str, Path]) -> None:
    url, _ = tls_url
    env = {k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"}
    out = bench(url, "--json", env=env)
    figures = json.loads(out.stdout)
    assert out.returncode == 1 and figures["completed"] == 0
    assert "CERTIFICATE_VERIFY_FAILED" in figures["first_error"]


# ---- progress -------------------------------------------------------------------------------


def _on_a_terminal(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd` with stderr on a pseudo-terminal; its exit code and what it drew there."""
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", TERMINAL_ROWS, TERMINAL_COLUMNS, 0, 0))
    drawn: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # EIO: the terminal's last writer is gone
                return
            if not data:
                return
            drawn.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        proc = subprocess.run(cmd, stderr=sub, stdout=subprocess.DEVNULL, timeout=60)
    finally:
        os.close(sub)
        reader.join(10)
        os.close(main)
    return proc.returncode, b"".join(drawn).decode(errors="replace")


def test_the_progress_bar_shows_elapsed_rate_and_eta(gateway: Proc) -> None:
    cmd = [sys.executable, "-m", "genq", "bench", "--url", gateway.url, "--concurrency", "4"]
    code, drawn = _on_a_terminal([*cmd, "--requests", str(REQUESTS), "--max-tokens", "5"])
    assert code == 0, drawn
    last = drawn.replace("\r", "\n").strip().splitlines()[-1]
    assert f"{REQUESTS}/{REQUESTS}" in last and "req/s" in last, last
    assert "00:00<00:00" in last, last  # elapsed < remaining
    code, drawn = _on_a_terminal([*cmd, "--requests", "4", "--max-tokens", "5", "--json"])
    assert code == 0 and "req/s" not in drawn and "4/4" not in drawn


def test_no_progress_bar_off_a_terminal(gateway: Proc) -> None:
    out = bench(gateway.url)
    assert out.returncode == 0 and "req/s" not in out.stderr and not out.stderr.strip()
