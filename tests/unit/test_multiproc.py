"""gateway/multiproc.py: the shared directory is emptied at start (or made), a dead process's
live gauges are dropped while its counters stay, and the fleet file is shown only while
fresh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import multiproc


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_prepare_empties_a_given_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(multiproc.ENV, str(tmp_path))
    (tmp_path / "counter_1.db").write_bytes(b"old")
    (tmp_path / multiproc.FLEET_FILE).write_bytes(b"old")
    (tmp_path / "keep.txt").write_text("not ours")
    assert multiproc.prepare() is None  # given, so not removed at exit either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_prepare_makes_a_directory_when_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(multiproc.ENV, "restored-at-teardown")  # prepare() sets it
    monkeypatch.delenv(multiproc.ENV)
    made = multiproc.prepare()
    try:
        assert made is not None and made.is_dir() and os.environ[multiproc.ENV] == str(made)
    finally:
        multiproc.remove(made)
    assert not made.exists()


def test_a_directory_left_by_a_killed_supervisor_goes_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    monkeypatch.setenv(multiproc.ENV, "restored-at-teardown")
    monkeypatch.delenv(multiproc.ENV)
    left = tmp_path / f"{multiproc.MADE_PREFIX}{_dead_pid()}-abc"
    running = tmp_path / f"{multiproc.MADE_PREFIX}{os.getpid()}-def"
    for d in (left, running):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"")
    made = multiproc.prepare()
    assert made is not None and made.name.startswith(f"{multiproc.MADE_PREFIX}{os.getpid()}-")
    assert not left.exists() and running.exists()
    multiproc.remove(made)


def test_a_dead_processs_live_gauges_go_and_its_counters_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(multiproc.ENV, str(tmp_path))
    dead, alive = _dead_pid(), os.getpid()
    for pid in (dead, alive):
        for kind in ("counter", "histogram", "gauge_livesum", "gauge_all"):
            (tmp_path / f"{kind}_{pid}.db").write_bytes(b"")
    multiproc.forget_dead()
    left = {p.name for p in tmp_path.iterdir()}
    assert f"gauge_livesum_{dead}.db" not in left
    assert {f"counter_{dead}.db", f"histogram_{dead}.db", f"gauge_all_{dead}.db"} <= left
    assert f"gauge_livesum_{alive}.db" in left


def test_the_fleet_file_is_shown_while_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(multiproc.ENV, str(tmp_path))
    multiproc.write_fleet(b"genq_dead_letters 0.0\n")
    assert multiproc.read_fleet(max_age_s=60) == b"genq_dead_letters 0.0\n"
    old = (tmp_path / multiproc.FLEET_FILE).stat().st_mtime - 120
    os.utime(tmp_path / multiproc.FLEET_FILE, (old, old))
    assert multiproc.read_fleet(max_age_s=60) == b""  # its writer died: another takes over
    multiproc.clear_fleet()
    assert multiproc.read_fleet(max_age_s=60) == b""
