"""A private `redis-server` for `genq serve` when no GENQ_REDIS_URL is given.

Its data is kept by default, in a per-user folder (`default_data_dir`, or `--data-dir`), with
the AOF on as deploy/redis.conf has it: jobs, results, quotas and keys outlive a restart of
`genq serve`. One `genq serve` at a time uses a folder: a lock file there is held by the
redis-server itself (it inherits the descriptor), so the folder is free again only once that
server has exited, whatever became of `genq serve`.

`--ephemeral` keeps nothing: the server persists nothing and its temporary folder is removed
as soon as it answers, so no folder is left behind even when `genq serve` is killed outright.

The server dies with `genq serve` (SIGTERM, on which it writes its AOF out and exits).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from shared import lifeline

log = logging.getLogger(__name__)
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
LOCK_FILE = "genq-serve.lock"
PERSISTENT = ["--appendonly", "yes", "--appendfsync", "everysec"]
"""As deploy/redis.conf: every write in the AOF, at most a second's lost on a power cut."""
NOTHING_ON_DISK = ["--appendonly", "no"]
COMMON = ["--save", "", "--maxmemory-policy", "noeviction"]
"""No RDB snapshots (the AOF has it all, or nothing is kept); a full Redis refuses writes
instead of evicting jobs."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/genq/redis, else ~/.local/share/genq/redis."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "genq" / "redis"


@contextlib.contextmanager
def private_redis(data_dir: Path | None, chosen: bool = True) -> Iterator[str | None]:
    """A redis-server of our own (its URL), keeping its data in `data_dir` (None: nothing
    kept), stopped on exit; None when the binary is missing. A folder that cannot be made
    stops the start with one line if it was `chosen`; the default one is only warned about
    (a read-only home still serves, keeping nothing)."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    lock = None if data_dir is None else _take(data_dir, chosen)
    if data_dir is None or lock is None:
        with _ephemeral(binary) as url:
            yield url
        return
    try:
        with _server(binary, data_dir, PERSISTENT, keep_fd=lock) as url:
            yield url
    finally:
        os.close(lock)


def _take(data_dir: Path, chosen: bool) -> int | None:
    """The folder made and locked (its lock's descriptor); None if it cannot be made and
    was not `chosen`."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return _lock(data_dir)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if chosen:
            raise SystemExit(
                f"genq: error: cannot keep data in {data_dir}: {reason} (another --data-dir, "
                "or --ephemeral)"
            ) from None
        log.warning(
            "cannot keep the private redis-server's data: keeping none (--data-dir DIR)",
            extra={"dir": str(data_dir), "reason": reason},
        )
        return None


@contextlib.contextmanager
def _ephemeral(binary: str) -> Iterator[str]:
    folder = Path(tempfile.mkdtemp(prefix="genq-redis-"))
    try:
        # gone once the server answers (it writes nothing there): none left behind later
        with _server(binary, folder, NOTHING_ON_DISK, on_up=lambda: shutil.rmtree(folder)) as url:
            yield url
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # when the server failed to start


def _lock(data_dir: Path) -> int:
    """The data folder's lock, held (SystemExit with one line when another holds it)."""
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SystemExit(
            f"genq: error: the data folder {data_dir} is in use (genq serve, pid {holder}): "
            "stop it, or give another --data-dir, or --ephemeral"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


@contextlib.contextmanager
def _server(
    binary: str,
    folder: Path,
    durability: list[str],
    keep_fd: int | None = None,
    on_up: Callable[[], None] | None = None,
) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            *durability,
            *COMMON,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # the folder's lock lives as long as this server (no other descriptor of ours)
        pass_fds=() if keep_fd is None else (keep_fd,),
        # SIGTERM if `genq serve` dies: redis-server writes its AOF out and exits
        preexec_fn=lifeline.preexec(),
    )
    try:
        _wait_for_port(port, proc)
        if on_up is not None:
            on_up()
        log.info("started private redis-server", extra={"port": port, "dir": str(folder)})
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start in time")
