"""prometheus-client's multiprocess mode for `genq gateway --workers N`.

Each of the N processes writes its metric values into files of one directory
(`PROMETHEUS_MULTIPROC_DIR`), and any of them renders the files of all, so a scrape that
reaches any process sees one consistent view. The directory must be in the environment
before prometheus_client is imported in the children, which `prepare` ensures: genq's
supervisor sets it before uvicorn spawns them (they start fresh interpreters and inherit
it). It is emptied at start, since values left by an earlier run would add to this run's; one
made here and left by a supervisor killed outright is removed when the next one starts.

A process that died leaves its files: counters must keep counting what it did, but its
live gauges (open streams) must stop counting, which `mark_process_dead` does; `forget_dead`
runs it for every process whose files remain and which no longer runs, before each render.

The fleet's gauges (gateway/fleet.py) are exported by one process of the fleet at a time;
in multiprocess mode that process also writes them to a file here, so that whichever of
its siblings answers a scrape includes them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from prometheus_client import multiprocess, values

ENV = "PROMETHEUS_MULTIPROC_DIR"
FLEET_FILE = "genq-fleet.prom"
MADE_PREFIX = "genq-metrics-"
"""A directory made here is MADE_PREFIX, the supervisor's pid, a dash and a random name."""
_PID = re.compile(r"_(\d+)\.db$")
_dead: set[int] = set()
"""Processes already marked dead (their files are read on every render)."""


def directory() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def active() -> bool:
    """Whether this process records into the shared directory (prometheus_client chose its
    value class when it was first imported, from the environment it saw then)."""
    return directory() is not None and values.ValueClass is not values.MutexValue


def prepare() -> Path | None:
    """Before the processes start: the directory (`PROMETHEUS_MULTIPROC_DIR` if set, else a
    fresh one) emptied and named in the environment. Returns the directory if it was made
    here (the caller removes it at exit), else None."""
    given = directory()
    if given is None:
        reclaim()
        made = Path(tempfile.mkdtemp(prefix=f"{MADE_PREFIX}{os.getpid()}-"))
        os.environ[ENV] = str(made)
        return made
    given.mkdir(parents=True, exist_ok=True)
    for stale in [*given.glob("*.db"), given / FLEET_FILE]:
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    return None


def reclaim() -> None:
    """Remove the directories that supervisors killed outright left (no cleanup ran in them):
    this user's, named for a process that no longer runs."""
    for path in Path(tempfile.gettempdir()).glob(f"{MADE_PREFIX}*-*"):
        pid = path.name.removeprefix(MADE_PREFIX).split("-")[0]
        with contextlib.suppress(OSError):
            if pid.isdigit() and path.stat().st_uid == os.getuid() and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def remove(made: Path | None) -> None:
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def forget_dead() -> None:
    """Mark every process that left files and no longer runs as dead (once each)."""
    path = directory()
    if path is None:
        return
    pids = {int(m.group(1)) for f in os.listdir(path) if (m := _PID.search(f))}
    for pid in pids - _dead:
        if not _alive(pid):
            multiprocess.mark_process_dead(pid, str(path))  # type: ignore[no-untyped-call]
            _dead.add(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid: not ours, yet alive
        return True
    return True


def write_fleet(body: bytes) -> None:
    """Replace the fleet file atomically (a sibling never reads half of it)."""
    path = directory()
    if path is None:
        return
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".fleet-")
    with os.fdopen(fd, "wb") as f:
        f.write(body)
    os.replace(tmp, path / FLEET_FILE)


def clear_fleet() -> None:
    path = directory()
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            (path / FLEET_FILE).unlink()


def read_fleet(max_age_s: float) -> bytes:
    """The fleet file, if it was written within `max_age_s` (an exporter that died without
    removing it leaves one that soon goes stale, and another process takes over)."""
    path = directory()
    if path is None:
        return b""
    try:
        with open(path / FLEET_FILE, "rb") as f:
            if time.time() - os.fstat(f.fileno()).st_mtime > max_age_s:
                return b""
            return f.read()
    except FileNotFoundError:
        return b""
