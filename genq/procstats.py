"""CPU time of the processes a benchmark starts (psutil): how much each part of the system
used while it ran."""

from __future__ import annotations

from collections.abc import Iterable

import psutil


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (its threads included, its children
    not); psutil.NoSuchProcess once it is gone."""
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def total_cpu_seconds(pids: Iterable[int]) -> float:
    """`cpu_seconds` summed over those of `pids` still alive."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except psutil.Error:
            continue
    return total


def children(pid: int) -> list[int]:
    """The live direct children of `pid`, by pid."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return []
    return sorted(p.pid for p in kids)


def process_tree(root: int) -> list[int]:
    """`root` and its live descendants, parents before children; [] when `root` is gone."""
    if not psutil.pid_exists(root):
        return []
    tree = [root]
    for pid in tree:  # grows as it goes
        tree += children(pid)
    return tree


def command_line(pid: int) -> str:
    """The process's command line, space-joined; "" once it is gone."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def pids_named(name: str) -> list[int]:
    """Live processes whose command name is `name` (e.g. "redis-server")."""
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == name]
