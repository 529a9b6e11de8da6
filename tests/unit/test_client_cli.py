"""The client commands as a user runs them (`python -m genq …` in a subprocess): a failure is
one line on stderr, never a traceback; the gateway comes from GENQ_URL as well as `--url`,
the API key from GENQ_API_KEY as well as `--api-key`; `genq bench` shows no empty figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.procs import free_port

RUN_S = 30.0
KEY = "sk-from-the-environment"


def _genq(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    return subprocess.run(
        [sys.executable, "-m", "genq", *args],
        capture_output=True,
        text=True,
        timeout=RUN_S,
        env={**base, **env},
    )


def _one_line(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("genq: error: "), done.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_batch_without_a_gateway_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    _one_line(_genq("batch", "status", "batch_" + "0" * 32, "--url", url), "nothing answers", url)


def test_batch_submit_of_a_missing_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    _one_line(_genq("batch", "submit", str(missing)), str(missing), "No such file")


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request 401 in the error shape, keeping its Authorization header."""

    seen: list[str | None]

    def _answer(self) -> None:
        self.seen.append(self.headers.get("authorization"))
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = json.dumps({"error": {"message": "wrong key", "type": "x"}}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[str | None]]]:
    seen: list[str | None] = []
    handler = type("Handler", (_Recorder,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "command",
    [
        ["batch", "list"],
        ["submit", "hello"],
        ["bench", "--requests", "1", "--concurrency", "1", "--max-tokens", "1"],
    ],
)
def test_client_commands_reach_genq_url_with_the_key_of_genq_api_key(
    recorder: tuple[str, list[str | None]], command: list[str]
) -> None:
    url, seen = recorder
    done = _genq(*command, GENQ_URL=url, GENQ_API_KEY=KEY)  # no --url: the variable's gateway
    assert done.returncode == 1  # the recorder refuses every key
    assert seen and set(seen) == {f"Bearer {KEY}"}, seen
    if command[0] == "bench":
        assert "first_error: HTTP 401" in done.stdout


def test_the_api_key_flag_wins_over_the_variable(recorder: tuple[str, list[str | None]]) -> None:
    url, seen = recorder
    given = _genq("batch", "list", "--url", url, "--api-key", "sk-flag", GENQ_API_KEY=KEY)
    assert given.returncode == 1 and seen == ["Bearer sk-flag"]


def test_bench_without_errors_prints_no_empty_first_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # no request is made: --requests 0
    bench = _genq("bench", "--url", url, "--requests", "0")
    assert bench.returncode == 0, bench.stderr
    assert "errors: 0" in bench.stdout and "None" not in bench.stdout
