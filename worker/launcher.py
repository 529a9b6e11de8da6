"""`genq worker --gpus 0,1 --procs-per-gpu N`: N worker processes per GPU, supervised.

One exllamav2 generator is bound by its own Python work long before the GPU is busy, so
several independent workers on one GPU generate more together; genq's queue balances them,
since each claims only what it can start now. Each child is a plain `genq worker` with
`CUDA_VISIBLE_DEVICES` set to its GPU, its own worker id, and 1/N of its GPU's batch slots
and cache (`--max-batch` and `--cache-tokens` are per GPU here). Weights are loaded once per
process: N copies of the model must fit on the GPU beside the caches.

The launcher restarts a child that dies (backoff doubling from `RESTART_BACKOFF_S` up to
`RESTART_BACKOFF_MAX_S`, reset once a child has stayed up `STABLE_AFTER_S`; its jobs are
reclaimed by the queue as usual) and passes SIGTERM/SIGINT on, so that every child drains.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from shared.settings import Settings

log = logging.getLogger("genq.worker.launcher")

RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
POLL_S = 0.2
KILL_MARGIN_S = 10.0
"""After SIGTERM a child has `shutdown_grace_s` plus this to leave before it is killed."""
PAGE_TOKENS = 256
DEFAULT_CACHE_TOKENS_PER_JOB = 1024


@dataclass
class Child:
    gpu: str
    index: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = RESTART_BACKOFF_S
    next_start: float = 0.0
    exit_codes: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"gpu{self.gpu}/p{self.index}"


def child_settings(settings: Settings, procs_per_gpu: int) -> dict[str, Any]:
    """Per-process share of one GPU: batch slots and cache tokens divided by N."""
    per = max(1, math.ceil(settings.max_batch / procs_per_gpu))
    cache = settings.cache_tokens or settings.max_batch * DEFAULT_CACHE_TOKENS_PER_JOB
    per_cache = max(PAGE_TOKENS, (cache // procs_per_gpu) // PAGE_TOKENS * PAGE_TOKENS)
    return {"max_batch": per, "cache_tokens": per_cache}


def settings_env(settings: Settings, **overrides: Any) -> dict[str, str]:
    """Settings as GENQ_* variables, so each child builds the same Settings object."""
    env: dict[str, str] = {}
    for name, value in {**settings.model_dump(), **overrides}.items():
        if value is None:
            continue
        if isinstance(value, list | dict):
            env[f"GENQ_{name.upper()}"] = json.dumps(value)
        else:
            env[f"GENQ_{name.upper()}"] = str(value)
    return env


class Launcher:
    def __init__(
        self, settings: Settings, gpus: list[str], procs_per_gpu: int,
        command: list[str] | None = None,
    ) -> None:
        self.settings = settings
        self.command = command or [sys.executable, "-m", "gateway.cli", "worker"]
        share = child_settings(settings, procs_per_gpu)
        base_id = settings.worker_id or socket.gethostname()
        self.children: list[Child] = []
        for gpu in gpus:
            for i in range(procs_per_gpu):
                env = {**os.environ, **settings_env(settings, **share)}
                env["CUDA_VISIBLE_DEVICES"] = gpu
                env["GENQ_WORKER_ID"] = f"{base_id}-g{gpu}p{i}"
                self.children.append(Child(gpu, i, env))
        self.stopping = False

    def _start(self, c: Child) -> None:
        env = dict(c.env)
        if c.restarts:  # a fresh id: the old one's entries are reclaimed like any dead worker's
            env["GENQ_WORKER_ID"] = f"{c.env['GENQ_WORKER_ID']}r{c.restarts}"
        c.proc = subprocess.Popen(self.command, env=env)
        c.started = time.monotonic()
        log.info("worker process started",
                 extra={"child": c.name, "pid": c.proc.pid, "worker_id": env["GENQ_WORKER_ID"]})

    def _stop(self, *_: object) -> None:
        if self.stopping:
            return
        self.stopping = True
        log.info("stopping worker processes (draining)")
        for c in self.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        return self.run_supervised()

    def run_supervised(self) -> int:
        """Start every child, keep them running until `_stop`, then wait for their drain."""
        for c in self.children:
            self._start(c)
        while not self.stopping:
            self._supervise(time.monotonic())
            time.sleep(POLL_S)
        return self._wait_all()

    def _supervise(self, now: float) -> None:
        for c in self.children:
            if c.proc is None:
                if now >= c.next_start:
                    self._start(c)
                continue
            code = c.proc.poll()
            if code is None:
                if now - c.started > STABLE_AFTER_S:
                    c.backoff = RESTART_BACKOFF_S
                continue
            c.exit_codes.append(code)
            c.proc = None
            c.restarts += 1
            c.next_start = now + c.backoff
            log.warning("worker process exited; restarting",
                        extra={"child": c.name, "code": code, "in_s": c.backoff})
            c.backoff = min(c.backoff * 2, RESTART_BACKOFF_MAX_S)

    def _wait_all(self) -> int:
        deadline = time.monotonic() + self.settings.shutdown_grace_s + KILL_MARGIN_S
        worst = 0
        for c in self.children:
            if c.proc is None:
                continue
            try:
                code = c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker process did not drain; killing", extra={"child": c.name})
                c.proc.kill()
                code = c.proc.wait()
            worst = worst or code
        return worst


def parse_gpus(spec: str | None) -> list[str]:
    """'0,1' → ['0', '1']; none given: the visible GPUs as CUDA_VISIBLE_DEVICES names them,
    else GPU 0."""
    if spec:
        return [g.strip() for g in spec.split(",") if g.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g for g in visible.split(",") if g] if visible else ["0"]


def run(settings: Settings, gpus: str | None, procs_per_gpu: int) -> int:
    return Launcher(settings, parse_gpus(gpus), procs_per_gpu).run()
