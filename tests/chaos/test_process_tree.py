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
import redis

from tests.conftest import REDIS_URL
from tests.prefixes import test_prefix
from tests.procs import QUICK_ENV, free_port

GONE_WITHIN_S = 8.0
"""SIGTERMed children drain (nothing to drain here) and exit; SIGKILLed ones go at once."""
START_S = 60.0
"""Several interpreters starting at once on a shared 2-core box."""
REFUSED_WITHIN_S = 20.0
"""A `genq serve` that cannot have its data folder exits well within this."""


@contextlib.contextmanager
def genq(tmp_path: Path, *args: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m genq ARGS` (no GENQ_* from this environment but QUICK_ENV and `env`); it and
    whatever it started are SIGKILLed at the end, so a failing test leaves nothing running."""
    with open(tmp_path / f"{args[0]}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(**env),
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


def clean_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    return {**base, **QUICK_ENV, "PYTHONUNBUFFERED": "1", **env}


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
    print(f"{len(tree)} processes, gone {time.monotonic() - deadline + GONE_WITHIN_S:.2f} s after")
    left = [f"{p.pid} {p.cmdline()}" for p in tree if running(p)]
    assert not left, f"processes outlived their parent: {left}"


def wait_tree(proc: subprocess.Popen[bytes], ready: Callable[[list[psutil.Process]], bool]) -> None:
    """Until `ready` says yes of `proc`'s processes; fails at once if `proc` exits."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the command exited with {proc.returncode}"
        with contextlib.suppress(psutil.Error, OSError, ValueError, AssertionError):
            if ready(descendants(proc)):
                return
        time.sleep(0.1)
    raise TimeoutError("its processes did not start")


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
        log = tmp_path / "gateway.log"
        wait_tree(proc, lambda _: log.read_text().count("Application startup complete") == 2)
        tree = descendants(proc)
        # both uvicorn processes serve: each holds the listening socket
        assert len(holders(socket_inode(proc.pid, port), tree)) == 2
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


needs_redis_server = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server on PATH"
)


@needs_redis_server
@pytest.mark.parametrize(
    "args",
    [[], ["--procs-per-gpu", "2"]],
    ids=["one-process", "worker-processes"],
)
def test_serve_ephemeral_leaves_no_process_and_no_folder(tmp_path: Path, args: list[str]) -> None:
    """`genq serve --ephemeral` with its private redis-server and the sim engine in its own
    process, or a launcher with two worker processes: only the gateway holds the listening
    socket, and a SIGKILL takes every process with it and leaves no folder behind."""
    port = free_port()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    serve = ["serve", "--port", str(port), "--ephemeral", *args]
    # with worker processes, their engines in-process (test_worker_processes_die_with_their_
    # launcher has engine processes below a launcher): two interpreters fewer to start
    env = {"GENQ_ENGINE_PROCESS": "false"} if args else {}
    with genq(tmp_path, *serve, TMPDIR=str(tmp), **env) as proc:
        # one process: redis-server, the engine's; else redis-server, launcher, 2 workers
        wait_tree(proc, lambda tree: len(tree) == (4 if args else 2))
        tree = descendants(proc)
        assert [p for p in tree if p.name() == "redis-server"]
        inode = socket_inode(proc.pid, port)
        assert holders(inode, tree) == [], "a child holds the gateway's listening socket"
        kill_and_expect_gone(proc, tree)
        assert can_bind(port), "the port is still held"
        assert list(tmp.iterdir()) == [], "left on disk"


def redis_port(tree: list[psutil.Process]) -> int:
    [server] = [p for p in tree if p.name() == "redis-server"]
    [conn] = [c for c in server.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    return int(conn.laddr.port)


@needs_redis_server
def test_serve_keeps_its_data_and_its_folder_is_one_servers(tmp_path: Path) -> None:
    """By default the private redis-server keeps its data in the per-user folder: a SIGKILLed
    `genq serve` takes its redis-server with it (which writes its AOF out on the way), the
    next one finds the data; meanwhile a second one on the same folder is refused."""
    data = Path(os.environ["XDG_DATA_HOME"]) / "genq" / "redis"
    with genq(tmp_path, "serve", "--port", str(free_port())) as first:
        wait_tree(first, lambda tree: bool(named(tree, "worker.engine_process")))
        tree = descendants(first)
        with redis.Redis(port=redis_port(tree)) as r:
            r.set("kept", "yes")
        second = subprocess.run(
            [sys.executable, "-m", "genq", "serve", "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=REFUSED_WITHIN_S,
            env=clean_env(),
        )
        assert second.returncode == 1
        assert f"the data folder {data} is in use" in second.stderr
        kill_and_expect_gone(first, tree)
    with genq(tmp_path, "serve", "--port", str(free_port())) as third:
        wait_tree(third, lambda tree: bool(named(tree, "worker.engine_process")))
        with redis.Redis(port=redis_port(descendants(third))) as r:
            assert r.get("kept") == b"yes", "the killed serve's data is lost"
