"""What a new user meets on the first run, with real `python -m genq` processes: chat on a
default `genq serve` through the official openai SDK, a busy port, no Redis, no gpu extra, a
missing model folder, a bad setting, a gateway that is down. Each failure is one line on
stderr and a non-zero exit, with nothing left running."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from shared import __version__
from shared.keys import Keys
from tests.conftest import REDIS_URL
from tests.prefixes import test_prefix
from tests.procs import free_port, wait_for

pytestmark = pytest.mark.e2e
EXIT_WITHIN_S = 20.0
"""A command that cannot start exits well within this (imports take ~1 s on a busy box)."""
SERVE_START_S = 30.0
MARKER = "GENQ_FIRST_RUN_TEST_MARKER"
"""Set in each started command's environment, which its children inherit: found in
/proc/*/environ after it exited, a process it started is still running."""


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    """A first-run environment (no GENQ_* set), marked so that its processes can be found."""
    marked = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    marked[MARKER] = uuid.uuid4().hex
    yield marked
    leftover = _processes_marked(marked[MARKER])
    for pid in leftover:  # only processes this test started carry its marker
        os.kill(pid, signal.SIGKILL)
    assert not leftover, "processes left running"


def _processes_marked(marker: str) -> list[int]:
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _genq(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run `python -m genq ARGS` to its exit; one still running after EXIT_WITHIN_S fails the
    test (its whole process group killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "genq", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"genq {' '.join(args)} still running after {EXIT_WITHIN_S}s: {err[-800:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _one_line_failure(r: subprocess.CompletedProcess[str], *words: str) -> str:
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for word in words:
        assert word in lines[0]
    return lines[0]


@pytest.fixture
def serve(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`genq serve` on its embedded defaults: (its URL, the file its stdout goes to)."""
    port = free_port()
    env = {**env, "GENQ_SIM_STEP_MS": "2"}
    out_path = tmp_path / "serve.out"
    with open(out_path, "wb") as out, open(tmp_path / "serve.err", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "serve", "--port", str(port)],
            stdout=out,
            stderr=err,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: httpx.get(f"{url}/v1/models").json()["data"],
            timeout=SERVE_START_S,
            what="genq serve",
        )
        yield url, out_path
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(SERVE_START_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_readme_chat_example_works_on_a_default_genq_serve(serve: tuple[str, Path]) -> None:
    url, _ = serve
    with openai.OpenAI(base_url=f"{url}/v1", api_key="anything", max_retries=0) as client:
        reply = client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8


def test_genq_serve_prints_its_url_and_a_curl_line_that_works(serve: tuple[str, Path]) -> None:
    url, out_path = serve
    banner, try_line = out_path.read_text().splitlines()[:2]
    assert f"on {url}" in banner and "'sim'" in banner
    command = try_line.removeprefix("try: ")
    assert command.startswith(f"curl -s {url}/v1/completions") and '"model": "sim"' in command
    r = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and '"text_completion"' in r.stdout, r.stdout


@pytest.mark.parametrize("flags", [[], ["--procs-per-gpu", "2"]], ids=["serve", "serve-multi"])
def test_the_suggested_request_sent_the_moment_it_is_printed_succeeds(
    env: dict[str, str], tmp_path: Path, flags: list[str]
) -> None:
    """No wait for /v1/models first, as a new user does not wait: the address is printed
    once a worker serves the model (multi: worker processes that take seconds to start)."""
    port = free_port()
    command = [sys.executable, "-m", "genq", "serve", "--port", str(port), "--ephemeral", *flags]
    with open(tmp_path / "serve.err", "wb") as err:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, text=True, env=env, bufsize=1
        )
    watchdog = threading.Timer(SERVE_START_S, proc.kill)  # a banner never printed: EOF
    watchdog.start()
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        try_line = next((line for line in lines if line.startswith("try: ")), "")
        watchdog.cancel()
        assert try_line, (tmp_path / "serve.err").read_text()[-2000:]
        r = subprocess.run(
            try_line.removeprefix("try: "), shell=True, capture_output=True, text=True, timeout=30
        )
        assert '"text_completion"' in r.stdout, r.stdout
        # how it stops is test_serve_ctrl_c's (multi: a worker process may still be starting)
        proc.send_signal(signal.SIGTERM)
        proc.wait(SERVE_START_S)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize(
    "command",
    [
        ["serve"],
        ["serve", "--procs-per-gpu", "2"],  # the gateway here, workers in a child
        ["gateway"],
        ["gateway", "--workers", "2"],
    ],
    ids=["serve", "serve-multi", "gateway", "gateway-workers"],
)
def test_a_busy_port_is_one_line_and_nothing_starts(
    env: dict[str, str], command: list[str]
) -> None:
    if command[0] == "gateway":
        env["GENQ_REDIS_URL"] = REDIS_URL
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = _genq(*command, "--port", str(port), env=env)
    _one_line_failure(r, f"127.0.0.1:{port}", "in use")
    assert r.stdout == ""  # no "serving on …" for an address that is not ours


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_no_redis_is_one_line_naming_the_flag_and_variable(
    env: dict[str, str], command: str
) -> None:
    _one_line_failure(_genq(command, env=env), "--redis-url", "GENQ_REDIS_URL")


def test_redis_url_flag_is_taken(env: dict[str, str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        r = _genq("gateway", "--redis-url", REDIS_URL, "--port", port, env=env)
    _one_line_failure(r, port)  # past the Redis check, to the port


def test_version(env: dict[str, str]) -> None:
    r = _genq("--version", env=env)
    assert r.returncode == 0 and r.stdout.strip() == f"genq {__version__}"


@pytest.mark.parametrize(
    ("variable", "value", "command"),
    [
        ("GENQ_API_KEYS_FILE", "/nonexistent/genq-keys", "gateway"),
        ("GENQ_MAX_BATCH", "many", "worker"),
        ("GENQ_LEASE_S", "-1", "serve"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable(
    env: dict[str, str], variable: str, value: str, command: str
) -> None:
    env |= {variable: value, "GENQ_REDIS_URL": REDIS_URL}
    _one_line_failure(_genq(command, env=env), variable)


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "Llama-3-8B-exl2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_a_missing_model_folder_is_named(env: dict[str, str], tmp_path: Path, command: str) -> None:
    env["GENQ_REDIS_URL"] = REDIS_URL
    missing = str(tmp_path / "no-such-model")
    _one_line_failure(_genq(command, "--model", missing, env=env), missing)


@pytest.mark.skipif(
    importlib.util.find_spec("exllamav2") is not None, reason="the gpu extra is installed"
)
@pytest.mark.parametrize("command", ["worker", "serve"])
def test_model_without_the_gpu_extra_says_install_it(
    env: dict[str, str], model_folder: Path, command: str
) -> None:
    env["GENQ_REDIS_URL"] = REDIS_URL
    _one_line_failure(_genq(command, "--model", str(model_folder), env=env), "genq[gpu]")


@pytest.mark.skipif(
    importlib.util.find_spec("numpy") is not None and importlib.util.find_spec("safetensors"),
    reason="synth-model's writer modules are installed",
)
def test_synth_model_without_the_gpu_extra_says_so_and_writes_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    parent = tmp_path / "models"
    parent.mkdir()
    _one_line_failure(_genq("synth-model", str(parent / "tiny"), env=env), "genq[gpu]")
    assert list(parent.iterdir()) == []


def test_submit_to_a_gateway_that_is_down_is_one_line(env: dict[str, str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    _one_line_failure(_genq("submit", "hello", "--url", url, env=env), url)


def test_a_worker_does_not_need_the_gateways_files(env: dict[str, str], tmp_path: Path) -> None:
    """One env file for all hosts: a gateway's key file and template need not exist on a
    worker's."""
    prefix = test_prefix("first")
    env |= {
        "GENQ_REDIS_URL": REDIS_URL,
        "GENQ_KEY_PREFIX": prefix,
        "GENQ_API_KEYS_FILE": str(tmp_path / "only-on-gateways" / "keys"),
        "GENQ_DEFAULT_CHAT_TEMPLATE": str(tmp_path / "only-on-gateways" / "chat.jinja"),
    }
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "worker"], stdout=log, stderr=log, env=env
        )
    try:
        with redis.Redis.from_url(REDIS_URL) as db:
            wait_for(
                lambda: db.exists(Keys(prefix).model_card("sim")) or proc.poll() is not None,
                timeout=SERVE_START_S,
                what="the worker's model card",
            )
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(SERVE_START_S) == 0
            db.delete(*db.keys(f"{prefix}*"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
