"""Children that die with their parent: no genq process outlives the one that started it.

A supervisor killed outright (SIGKILL, the OOM killer) runs no cleanup, so its children would
run on orphaned: gateway processes still answering on the port, a redis-server on its folder.
On Linux the kernel can signal a child when its parent dies (`PR_SET_PDEATHSIG`); each child
arms it, either before its program starts (`preexec`, for a `subprocess.Popen` child, any
binary: the setting survives exec) or first thing in its own startup (`die_with_parent`, for a
child started by code genq does not control, as uvicorn's and multiprocessing's). Elsewhere
these are no-ops.

The signal comes when the *thread* that started the child exits, not the process: start
children from a thread that lives as long as the process (the main thread, the event loop's).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
# Loaded here, in the parent: `preexec` runs between fork and exec, where loading a library
# could deadlock on a lock another thread of the parent held at the fork.
_libc = ctypes.CDLL(None, use_errno=True) if _LINUX else None


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Ask for `sig` when the process `parent` (this process's parent when it started) dies;
    exit at once if it already has (it died before this call, and no signal will come)."""
    if _libc is None:
        return
    _libc.prctl(_PR_SET_PDEATHSIG, int(sig))
    # The parent may have died between this process's start and the prctl: it was then
    # reparented (to init or a subreaper) and the signal will never come.
    if os.getppid() != parent:
        os._exit(1)


def preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when this process dies.
    None where the platform has no such signal."""
    if _libc is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        die_with_parent(parent, sig)

    return arm


def record_stops() -> list[int]:
    """From now until the process installs its own handlers, SIGTERM and SIGINT are noted in
    the list returned instead of ending it: a supervisor's stop that comes while the process
    still starts (imports, a model loading) ends the start cleanly once the process can act on
    it, rather than the default handlers killing it mid-way (a death by signal that its
    supervisor would report as a failure)."""
    seen: list[int] = []

    def note(signum: int, frame: object) -> None:
        seen.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, note)
    return seen
