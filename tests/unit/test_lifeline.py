"""shared/lifeline.py: a child whose parent died before it asked to die with it exits at
once (the death signal would never come); one whose parent lives runs on."""

from __future__ import annotations

import subprocess
import sys

ASK = "import os; from shared import lifeline; lifeline.die_with_parent({parent}); print('ran')"


def _run(parent: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", ASK.format(parent=parent)],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_child_whose_parent_is_already_gone_exits() -> None:
    # the parent it names is not its parent now: as when that one died and it was reparented
    done = _run("os.getppid() + 1")
    assert (done.returncode, done.stdout) == (1, "")


def test_a_child_whose_parent_lives_runs_on() -> None:
    done = _run("os.getppid()")
    assert (done.returncode, done.stdout) == (0, "ran\n")
