"""CPU placement of worker processes: cpulists, the host's cores from sysfs, the plan, and a
real `genq worker` pinned by the launcher."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import redis

from genq.launcher import Launcher
from shared.keys import Keys
from shared.settings import Settings
from tests.conftest import REDIS_URL, test_prefix
from tests.procs import wait_for
from worker import cpus
from worker.cpus import Core


def test_cpulists_round_trip_and_refuse_garbage() -> None:
    assert cpus.parse_cpulist("0-3,8, 10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cpus.format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert cpus.format_cpulist([5]) == "5"
    for bad in ("", "a", "3-1", "1-", "-2"):
        with pytest.raises(ValueError):
            cpus.parse_cpulist(bad)
    with pytest.raises(ValueError, match="cpus"):
        Settings(cpus="0-3; rm -rf /")


def _sysfs(root: Path, smt: dict[int, str], nodes: dict[int, int]) -> Path:
    for cpu, siblings in smt.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(siblings + "\n")
        (root / f"cpu{cpu}" / f"node{nodes[cpu]}").mkdir()
    return root


def test_host_cores_keeps_siblings_together_with_their_node(tmp_path: Path) -> None:
    # 4 cores, 2-way SMT (siblings n and n+4), cores 0-1 on node 0, 2-3 on node 1
    smt = {c: f"{c % 4},{c % 4 + 4}" for c in range(8)}
    root = _sysfs(tmp_path, smt, {c: (c % 4) // 2 for c in range(8)})
    assert cpus.host_cores(range(8), root) == [
        Core((0, 4), 0),
        Core((1, 5), 0),
        Core((2, 6), 1),
        Core((3, 7), 1),
    ]
    # a process allowed only some CPUs sees only those siblings
    assert cpus.host_cores([1, 2, 6], root) == [Core((1,), 0), Core((2, 6), 1)]
    # no sysfs at all: one core per CPU, node unknown
    assert cpus.host_cores([0, 1], tmp_path / "none") == [Core((0,), None), Core((1,), None)]


def test_plan_gives_disjoint_whole_cores_near_each_gpu() -> None:
    cores = [Core((c, c + 16), c // 8) for c in range(16)]  # 16 cores, 2 nodes, SMT 2
    sets = cpus.plan(["0", "0", "1", "1"], cores, {"0": 1, "1": 0})
    assert sets == [[8, 9, 24, 25], [10, 11, 26, 27], [0, 1, 16, 17], [2, 3, 18, 19]]
    # more children than fit on a node: the rest come from the other node
    sets = cpus.plan(["0"] * 6, cores, {"0": 0})
    assert sets is not None and [min(s) for s in sets] == [0, 2, 4, 6, 8, 10]
    flat = [c for s in sets for c in s]
    assert len(flat) == len(set(flat)) == 24


def test_plan_leaves_spare_cores_or_pins_nothing() -> None:
    cores = [Core((c,), None) for c in range(16)]  # no SMT, no NUMA information
    assert cpus.plan(["0", "1"], cores, {}) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cpus.plan(["0", "1", "0"], cores, {}) is not None  # 12 pinned, 4 spare
    assert cpus.plan(["0", "1"] * 2, cores, {}) is None  # every core taken: better unpinned
    assert cpus.plan(["0"] * 3, cores[:2], {}) is None
    assert cpus.plan(["0"], cores, {}, cpus_per_proc=2) == [[0, 1]]


def test_gpu_numa_node_from_the_pci_address(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dev = tmp_path / "0000:1b:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    asked: list[str] = []

    def bus_id(gpu: str) -> str:
        asked.append(gpu)
        return "00000000:1B:00.0"

    monkeypatch.setattr(cpus, "pci_bus_id", bus_id)
    assert cpus.gpu_numa_node("3", tmp_path) == 1
    assert asked == ["3"]
    (dev / "numa_node").write_text("-1\n")  # the host does not know
    assert cpus.gpu_numa_node("3", tmp_path) is None
    monkeypatch.setattr(cpus, "pci_bus_id", lambda gpu: None)  # neither NVML nor nvidia-smi
    assert cpus.gpu_numa_node("3", tmp_path) is None


def test_auto_pins_only_several_exllamav2_processes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = [[0, 1], [2, 3]]
    monkeypatch.setattr(cpus, "plan_for_host", lambda placement: fake[: len(placement)])
    exl = Settings(engine="exllamav2", model_dir="/m")
    envs = [c.env for c in Launcher(exl, ["0", "1"], 1).children]
    assert [e["GENQ_CPUS"] for e in envs] == ["0-1", "2-3"]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["2", "2"]
    assert "GENQ_CPUS" not in Launcher(exl, ["0"], 1).children[0].env  # one process
    assert "GENQ_CPUS" not in Launcher(Settings(), ["0"], 2).children[0].env  # sim
    off = exl.model_copy(update={"cpu_affinity": "off"})
    assert "GENQ_CPUS" not in Launcher(off, ["0", "1"], 1).children[0].env
    on = Settings(cpu_affinity="on")
    assert Launcher(on, ["0"], 2).children[1].env["GENQ_CPUS"] == "2-3"


def test_unpinned_processes_keep_the_default_thread_pools(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cpus, "plan_for_host", lambda placement: None)  # every core taken
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    exl = Settings(engine="exllamav2", model_dir="/m")
    envs = [c.env for c in Launcher(exl, ["0", "1"], 4).children]
    assert all("GENQ_CPUS" not in e and "OMP_NUM_THREADS" not in e for e in envs)
    assert all("GENQ_SAMPLING_THREADS" not in e for e in envs)
    # an operator's own sampling threads reach every process
    wide = exl.model_copy(update={"sampling_threads": 16})
    env = Launcher(wide, ["0", "1"], 4).children[0].env
    assert env["GENQ_SAMPLING_THREADS"] == "16"
    assert Settings.model_validate({"sampling_threads": env["GENQ_SAMPLING_THREADS"]})


def _allowed(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return cpus.parse_cpulist(line.split(":", 1)[1])
    raise AssertionError("no Cpus_allowed_list")


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two CPUs",
)
def test_launched_workers_run_on_their_own_cpus(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    prefix = test_prefix()
    monkeypatch.setenv("GENQ_KEY_PREFIX", prefix)
    settings = Settings(redis_url=REDIS_URL, shutdown_grace_s=2, worker_id="pin")
    first, second = sorted(os.sched_getaffinity(0))[:2]
    cmd = [sys.executable, "-m", "genq", "worker"]
    la = Launcher(settings, ["0"], 2, command=cmd, cpu_sets=[[first], [second]])
    t = threading.Thread(target=la.run_supervised)
    t.start()
    try:
        want = [[first], [second]]
        assert [c.env["GENQ_CPUS"] for c in la.children] == [str(first), str(second)]
        wait_for(lambda: all(c.proc is not None for c in la.children), what="children started")
        pids = [c.proc.pid for c in la.children if c.proc is not None]
        wait_for(
            lambda: [_allowed(p) for p in pids] == want,
            timeout=20,
            what=f"workers pinned to {want}",
        )
        with redis.Redis.from_url(REDIS_URL) as db:  # up, signal handlers in place: drainable
            beats = [Keys(prefix).worker(f"pin-g0p{i}") for i in range(2)]
            wait_for(lambda: db.exists(*beats) == 2, timeout=20, what="heartbeats")
    finally:
        la._stop()
        t.join(30)
    assert all(c.proc is not None and c.proc.returncode == 0 for c in la.children)
