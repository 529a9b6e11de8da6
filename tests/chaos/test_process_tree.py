"""No process outlives its parent: SIGKILL each genq process that starts others (`genq gateway
--workers 2`, a launcher, a worker with its engine process, `genq serve`) and every process
below it is gone within seconds, its port can be bound again, and nothing but the gateway
ever held the gateway's listening socket."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import REDIS_URL
from tests.prefixes import test_prefix
from tests.procs import QUICK_ENV, free_port, wait_for

GONE_WITHIN_S = 8.0
"""SIGTERMed children drain (nothing to drain here) and exit; SIGKILLed ones go at once."""
START_S = 60.0
"""Several interpreters starting at once on a shared 2-core box."""


@contextlib.contextmanager
def genq(tmp_path: Path, *args: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m genq ARGS` (no GENQ_* from this environment but QUICK_ENV and `env`); it and
    whatever it started are SIGKILLed at the end, so a failing test leaves nothing running."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    with open(tmp_path / f"{args[0]}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**base, **QUICK_ENV, "PYTHONUNBUFFERED": "1", **env},
        )
    tree = psutil.Process(proc.pid)
    seen: list[psutil.Process] = []
    try:
        yield proc
    finally:
        with contextlib.suppress(psutil.Error):
            seen = tree.children(recursive=True)
        proc.kill()
        proc.wait()
        for p in seen:  # only processes this test started
            with contextlib.suppress(psutil.Error):
                p.kill()
        print((tmp_path / f"{args[0]}.log").read_text(errors="replace")[-3000:])


def descendants(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_and_expect_gone(proc: subprocess.Popen[bytes], tree: list[psutil.Process]) -> None:
    """SIGKILL `proc`; every process of `tree` must be gone within GONE_WITHIN_S."""
    assert tree, "no child process to watch"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and any(running(p) for p in tree):
        time.sleep(0.05)
    left = [f"{p.pid} {p.cmdline()}" for p in tree if running(p)]
    assert not left, f"processes outlived their parent: {left}"


def wait_tree(proc: subprocess.Popen[bytes], ready: Callable[[list[psutil.Process]], bool]) -> None:
    def check() -> bool:
        assert proc.poll() is None, "the command exited"
        return ready(descendants(proc))

    wait_for(check, timeout=START_S, interval=0.1, what="its processes")


def named(tree: list[psutil.Process], word: str) -> list[psutil.Process]:
    out = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            if any(word in part for part in p.cmdline()):
                out.append(p)
    return out


def socket_inode(pid: int, port: int) -> int:
    """The inode of the socket listening on `port` in process `pid`."""
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            return int(os.readlink(f"/proc/{pid}/fd/{c.fd}")[len("socket:[") : -1])
    raise AssertionError(f"{pid} does not listen on {port}")


def holders(inode: int, tree: list[psutil.Process]) -> list[int]:
    """The processes of `tree` with a descriptor of socket `inode`."""
    out = []
    for p in tree:
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{p.pid}/fd")
            if any(_link(f"/proc/{p.pid}/fd/{fd}") == f"socket:[{inode}]" for fd in fds):
                out.append(p.pid)
    return out


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def can_bind(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as `genq gateway` binds
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def redis_env(tag: str) -> dict[str, str]:
    return {"GENQ_REDIS_URL": REDIS_URL, "GENQ_KEY_PREFIX": test_prefix(tag)}


def test_gateway_processes_die_with_their_supervisor(tmp_path: Path) -> None:
    port = free_port()
    args = ["gateway", "--port", str(port), "--workers", "2"]
    with genq(tmp_path, *args, **redis_env("tree-gw")) as proc:
        # both uvicorn processes serve: each holds the listening socket
        wait_tree(proc, lambda tree: len(holders(socket_inode(proc.pid, port), tree)) == 2)
        tree = descendants(proc)
        kill_and_expect_gone(proc, tree)
        assert can_bind(port), "the port is still held"


def test_worker_processes_die_with_their_launcher(tmp_path: Path) -> None:
    args = ["worker", "--procs-per-gpu", "2"]
    with genq(tmp_path, *args, **redis_env("tree-launcher")) as proc:
        # each worker process has loaded its engine (in its own process)
        wait_tree(proc, lambda tree: len(named(tree, "worker.engine_process")) == 2)
        tree = descendants(proc)
        assert len(tree) == 4  # two workers, their engine processes
        kill_and_expect_gone(proc, tree)


def test_the_engine_process_dies_with_its_worker(tmp_path: Path) -> None:
    with genq(tmp_path, "worker", **redis_env("tree-worker")) as proc:
        wait_tree(proc, lambda tree: len(named(tree, "worker.engine_process")) == 1)
        kill_and_expect_gone(proc, descendants(proc))


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_serve_leaves_no_process_and_no_folder(tmp_path: Path) -> None:
    """`genq serve` with its private redis-server and the sim engine in its own process: only
    the gateway holds the listening socket, and a SIGKILL takes everything with it."""
    port = free_port()
    with genq(tmp_path, "serve", "--port", str(port), "--ephemeral") as proc:
        wait_tree(proc, lambda tree: bool(named(tree, "worker.engine_process")))
        tree = descendants(proc)
        [redis] = [p for p in tree if p.name() == "redis-server"]
        folder = Path(redis.cwd())
        inode = socket_inode(proc.pid, port)
        assert holders(inode, tree) == [], "a child holds the gateway's listening socket"
        kill_and_expect_gone(proc, tree)
        assert can_bind(port), "the port is still held"
        assert not folder.exists(), f"{folder} left on disk"
