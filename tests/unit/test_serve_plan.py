"""`genq serve` decides once, before anything starts, whether it runs one process or a
launcher of several (issue 11: no `None` as a signal through gateway → worker → gateway); the
settings each process builds hold only its own sections; a job's default seed is the same in
every process."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from genq.serve import ServePlan, plan_serve
from shared.settings import GatewaySettings, Settings, WorkerSettings
from worker.claims import seed_of

HEX_ID = "0123456789abcdef" * 2


def test_the_sim_engine_serves_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = plan_serve(Settings(), gpus=None, procs_per_gpu="auto")
    assert plan == ServePlan(["0"], 1) and not plan.multi


def test_several_gpus_or_processes_make_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan_serve(Settings(), gpus="0", procs_per_gpu="2").multi
    assert plan_serve(Settings(), gpus="0,1", procs_per_gpu="1") == ServePlan(["0", "1"], 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert plan_serve(Settings(), gpus=None, procs_per_gpu="1").gpus == ["3", "5"]


def test_a_gateway_does_not_check_what_only_a_worker_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GENQ_CHAT_TEMPLATE", "/no/such/template.jinja")
    assert GatewaySettings().key_prefix  # the gateway starts
    with pytest.raises(ValidationError, match="chat_template"):
        WorkerSettings()


def test_a_jobs_default_seed_is_the_same_in_every_process() -> None:
    assert seed_of(HEX_ID) == int(HEX_ID[:16], 16)
    code = "from worker.claims import seed_of; print(seed_of('not-hex'), seed_of('x' * 40))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(n), "PATH": ""},
        ).stdout
        for n in (0, 1, 2)
    }
    assert len(runs) == 1  # not Python's per-process hash()
    assert runs.pop().split() == [str(seed_of("not-hex")), str(seed_of("x" * 40))]
