"""worker/gpus.py: NVML (a stand-in `pynvml` module) first, a stand-in `nvidia-smi` on PATH
when NVML is missing or fails, None when neither answers."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker import gpus

GIB = 1024**3
UUID = "GPU-5c3f0a2e-1111-2222-3333-444455556666"


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """pynvml's calls genq makes, over two GPUs; `fail_init` plays a host without a driver."""

    NVMLError = FakeNVMLError

    def __init__(self, fail_init: bool = False, bus_as_bytes: bool = False) -> None:
        self.fail_init = fail_init
        self.bus_as_bytes = bus_as_bytes
        self.open = 0
        self.devices = {
            0: {"uuid": "GPU-aaaa", "free": 70 * GIB, "bus": "00000000:1B:00.0"},
            1: {"uuid": UUID, "free": 20 * GIB, "bus": "00000000:9A:00.0"},
        }

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index not in self.devices:
            raise FakeNVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for i, d in self.devices.items():
            if d["uuid"] == uuid:
                return i
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(free=self.devices[handle]["free"], total=141 * GIB)

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        bus = str(self.devices[handle]["bus"])
        return SimpleNamespace(busId=bus.encode() if self.bus_as_bytes else bus)


_SMI = """#!{python}
import json, sys
answers = json.load(open({answers!r}))
args = sys.argv[1:]
field = next(a.split("=", 1)[1] for a in args if a.startswith("--query-gpu="))
gpu = args[args.index("-i") + 1]
if gpu not in answers:
    print("No devices were found", file=sys.stderr)
    sys.exit(6)
print(answers[gpu][field])
"""


class Smi:
    """Answers of the stand-in nvidia-smi: GPU name → field → value, as
    `--format=csv,noheader,nounits` prints it."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.answers: dict[str, dict[str, str]] = {}
        file.write_text("{}")

    def knows(self, gpu: str, memory_free: str, pci_bus_id: str) -> None:
        self.answers[gpu] = {"memory.free": memory_free, "pci.bus_id": pci_bus_id}
        self.file.write_text(json.dumps(self.answers))


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Smi:
    """A stand-in nvidia-smi, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answers = Smi(tmp_path / "answers.json")
    script = bin_dir / "nvidia-smi"
    script.write_text(_SMI.format(python=sys.executable, answers=str(answers.file)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return answers


@pytest.fixture
def no_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH on which no nvidia-smi can be found."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _with_nvml(monkeypatch: pytest.MonkeyPatch, nvml: FakeNVML | None) -> None:
    # None in sys.modules makes `import pynvml` raise ImportError, as on a CPU install
    monkeypatch.setitem(sys.modules, "pynvml", nvml)


def test_nvml_answers_by_index_and_by_uuid(monkeypatch: pytest.MonkeyPatch, no_smi: None) -> None:
    nvml = FakeNVML()
    _with_nvml(monkeypatch, nvml)
    assert gpus.free_memory_bytes("0") == 70 * GIB
    assert gpus.free_memory_bytes(UUID) == 20 * GIB
    assert gpus.pci_bus_id("1") == "00000000:9A:00.0"
    assert gpus.pci_bus_id(UUID) == "00000000:9A:00.0"
    assert nvml.open == 0  # every nvmlInit had its nvmlShutdown


def test_older_nvml_bus_ids_come_as_bytes(monkeypatch: pytest.MonkeyPatch, no_smi: None) -> None:
    _with_nvml(monkeypatch, FakeNVML(bus_as_bytes=True))
    assert gpus.pci_bus_id("0") == "00000000:1B:00.0"


def test_nvidia_smi_answers_without_pynvml(monkeypatch: pytest.MonkeyPatch, smi: Smi) -> None:
    _with_nvml(monkeypatch, None)
    smi.knows("0", memory_free="81000", pci_bus_id="00000000:1B:00.0")
    smi.knows(UUID, memory_free="1024", pci_bus_id="00000000:9A:00.0")
    assert gpus.free_memory_bytes("0") == 81000 * 1024**2
    assert gpus.free_memory_bytes(UUID) == 1024 * 1024**2
    assert gpus.pci_bus_id("0") == "00000000:1B:00.0"
    assert gpus.free_memory_bytes("7") is None  # nvidia-smi: no such GPU


def test_nvidia_smi_answers_when_nvml_fails(monkeypatch: pytest.MonkeyPatch, smi: Smi) -> None:
    smi.knows("0", memory_free="512", pci_bus_id="00000000:1B:00.0")
    smi.knows("2", memory_free="256", pci_bus_id="00000000:3C:00.0")
    _with_nvml(monkeypatch, FakeNVML(fail_init=True))  # no driver for NVML
    assert gpus.free_memory_bytes("0") == 512 * 1024**2
    nvml = FakeNVML()
    _with_nvml(monkeypatch, nvml)  # NVML up, but it has no GPU 2
    assert gpus.pci_bus_id("2") == "00000000:3C:00.0"
    assert nvml.open == 0


def test_none_when_neither_answers(monkeypatch: pytest.MonkeyPatch, no_smi: None) -> None:
    _with_nvml(monkeypatch, None)
    assert gpus.free_memory_bytes("0") is None
    assert gpus.pci_bus_id("0") is None
    _with_nvml(monkeypatch, FakeNVML(fail_init=True))
    assert gpus.free_memory_bytes(UUID) is None
    assert gpus.free_memory_bytes("not-a-gpu") is None
