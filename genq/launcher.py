"""`genq worker --gpus 0,1 --procs-per-gpu N`: N worker processes per GPU, supervised.

One exllamav2 generator is bound by its own Python work long before the GPU is busy, so
several independent workers on one GPU generate more together; genq's queue balances them,
since each claims only what it can start now. Each child is a plain `genq worker` with
`CUDA_VISIBLE_DEVICES` set to its GPU, its own worker id, and 1/N of its GPU's batch slots
and cache (`--max-batch` and `--cache-tokens` are per GPU here). Weights are loaded once per
process: N copies of the model must fit on the GPU beside the caches.

Before any child starts, the GPU's memory is shared among them (genq/gpu_share.py): each
gets a cache its share of the memory holds, or the launcher refuses to start at all.

The launcher restarts a child that dies (backoff doubling from `RESTART_BACKOFF_S` up to
`RESTART_BACKOFF_MAX_S`, reset once a child has stayed up `STABLE_AFTER_S`; its jobs are
reclaimed by the queue as usual), but only `GENQ_RESTART_LIMIT` times within
`GENQ_RESTART_WINDOW_S`: a child that dies once more in that window is a crash loop the
launcher cannot fix (a bad GPU, a process that does not fit), so it stops that child alone:
the others go on serving. It says so in its log and in Redis (`Keys.stopped_workers`, which
the gateways' /readyz reads: the model's capacity dropped), every `STOPPED_REPORT_S` while it
runs. Once no child is left, it exits `CRASH_LOOP_EXIT` — restarting the whole set, with its
own backoff and alerting, is then the job of systemd or Kubernetes; so does a launcher
stopped later, one of whose children it had stopped. SIGTERM/SIGINT are passed on, so that
every child drains; the same signal again is passed on again (each child then hands its jobs
back at once).
"""

from __future__ import annotations

import collections
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
from pathlib import Path
from typing import Any

import redis
from pydantic import SecretStr
from redis.cluster import ClusterNode
from redis.exceptions import RedisError
from redis.sentinel import Sentinel

from genq import gpu_share
from genq.gpu_share import CACHE_BYTES_PER_ELEMENT, GPU_MEMORY_USABLE, PROC_OVERHEAD_BYTES
from shared import lifeline
from shared.keys import Keys
from shared.records import StoppedWorker
from shared.settings import WorkerSettings, sentinel_address
from worker import cpus
from worker.dyngen.backend import cache_tokens
from worker.exl2 import loader

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
POLL_S = 0.2
KILL_MARGIN_S = 10.0
"""After SIGTERM a child has `shutdown_grace_s` plus this to leave before it is killed."""
CRASH_LOOP_EXIT = 1
"""The launcher's exit code after a child exceeded its restarts (a failure to systemd)."""
STOPPED_REPORT_S = 5.0
"""How often the launcher writes its stopped children to Redis again; each entry is shown
for `STOPPED_REPORT_TTL_S` after its last write (a launcher gone, they lapse)."""
STOPPED_REPORT_TTL_S = 3 * STOPPED_REPORT_S

# `--procs-per-gpu auto`: as many processes as memory and CPU allow, up to the point where
# more stopped paying on an H200 with an 8B model (docs/performance.md). With sampling
# on the GPU (the default) a process is one core (its generator thread, GIL-bound) and the GPU
# is the shared part: 2 per GPU was best or within 9 % of the best from 64 to 256 streams, 4
# worse at every level. With exllamav2's CPU sampler a process wants ~4 cores and 4 did best.
# Re-measured with the engine process (docs/performance.md, "Processes per GPU"): two
# processes are 1.09 x one at 256 streams on an H200, 0.87-0.92 x at 64-128, and 0.85 x one
# on the multi-turn chat shape with placement before its cache state was precise. The sweep on
# the present placement (`tests.bench.placement --model DIR --procs 1,2,3,4`, an H100,
# 2026-12-07): 2 processes 0.72 x one on the multi-turn shape, 0.99-1.11 x at 256 streams, 3
# at 0.58 x on both, 4 do not fit an 8B fp16: one process per GPU (GENQ_AUTO_PROCS_MAX).
AUTO_MAX_PROCS: int = WorkerSettings.model_fields["auto_procs_max"].default
CORES_PER_PROC = 2
AUTO_MAX_PROCS_CPU_SAMPLING = 4
CORES_PER_PROC_CPU_SAMPLING = 4


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
    recent_restarts: collections.deque[float] = field(default_factory=collections.deque)
    """When this child was last restarted, within the restart window."""
    stopped_at: float | None = None
    """When the launcher gave up on it (a crash loop; unix seconds): never restarted again."""

    @property
    def name(self) -> str:
        return f"gpu{self.gpu}/p{self.index}"


def child_settings(
    settings: WorkerSettings, procs_per_gpu: int, share: gpu_share.Share | None = None
) -> dict[str, Any]:
    """Per-process share of one GPU: batch slots and cache tokens divided by N, the cache no
    larger than the process's share of the GPU's memory holds (`share`, when known)."""
    per = max(1, math.ceil(settings.max_batch / procs_per_gpu))
    per_cache = gpu_share.process_cache_tokens(settings, procs_per_gpu, share)
    return {"max_batch": per, "cache_tokens": per_cache}


def gpu_cache_tokens(settings: WorkerSettings) -> int:
    """Cache tokens for one GPU: what one exllamav2 worker there would allocate by itself."""
    seq_len = loader.max_seq_len(settings) or 0
    return cache_tokens(settings.cache_tokens, seq_len, settings.max_batch)


def settings_env(settings: WorkerSettings, **overrides: Any) -> dict[str, str]:
    """Settings as GENQ_* variables, so each child builds the same Settings object."""
    env: dict[str, str] = {}
    for name, value in {**settings.model_dump(), **overrides}.items():
        if value is None:
            continue
        if isinstance(value, SecretStr):  # a password the child needs, not its mask
            value = value.get_secret_value()
        if isinstance(value, list | dict):
            env[f"GENQ_{name.upper()}"] = json.dumps(value)
        else:
            env[f"GENQ_{name.upper()}"] = str(value)
    return env


class Launcher:
    def __init__(
        self,
        settings: WorkerSettings,
        gpus: list[str],
        procs_per_gpu: int,
        command: list[str] | None = None,
        cpu_sets: list[list[int]] | None = None,
        memory: gpu_share.Share | None = None,
    ) -> None:
        """`memory`: how the GPUs' memory is shared (`gpu_share.check_fits`), when known."""
        self.settings = settings
        self.command = command or [sys.executable, "-m", "genq", "worker"]
        share = child_settings(settings, procs_per_gpu, memory)
        base_id = settings.worker_id or socket.gethostname()
        placement = [gpu for gpu in gpus for _ in range(procs_per_gpu)]
        cpu_sets = cpu_sets_for(settings, placement) if cpu_sets is None else cpu_sets
        self.children: list[Child] = []
        for n, gpu in enumerate(placement):
            i = n % procs_per_gpu
            env = {**os.environ, **settings_env(settings, **share)}
            env["CUDA_VISIBLE_DEVICES"] = gpu
            env["GENQ_WORKER_ID"] = f"{base_id}-g{gpu}p{i}"
            if settings.metrics_port is not None:  # one host, one port each
                env["GENQ_METRICS_PORT"] = str(settings.metrics_port + n)
            if cpu_sets:
                env["GENQ_CPUS"] = cpus.format_cpulist(cpu_sets[n])
                # thread pools sized to the set (OpenMP reads this, not the affinity mask);
                # unpinned processes keep the defaults: on a 32-core host, 2 x 4 processes
                # with 4 sampling threads each made 20 % fewer tokens than with 16
                env.setdefault("OMP_NUM_THREADS", str(len(cpu_sets[n])))
            self.children.append(Child(gpu, i, env))
        self.stopping = False
        self._signals: set[int] = set()
        """The signals that stopped the launcher so far."""
        self.crash_loop: Child | None = None
        """The first child whose deaths passed the restart limit, once one has."""
        self._reported_at = 0.0
        self._redis: redis.Redis | None = None

    def _start(self, c: Child) -> None:
        env = dict(c.env)
        if c.restarts:  # a fresh id: the old one's entries are reclaimed like any dead worker's
            env["GENQ_WORKER_ID"] = f"{c.env['GENQ_WORKER_ID']}r{c.restarts}"
        # SIGTERM when the launcher dies, however it dies: the child drains and exits
        c.proc = subprocess.Popen(self.command, env=env, preexec_fn=lifeline.preexec())
        c.started = time.monotonic()
        log.info(
            "worker process started",
            extra={
                "child": c.name,
                "pid": c.proc.pid,
                "worker_id": env["GENQ_WORKER_ID"],
                "cpus": env.get("GENQ_CPUS", "any"),
            },
        )

    def _stop(self, signum: int | None = None, frame: object = None) -> None:
        """Drain every child (SIGTERM); the same signal once more (a second Ctrl-C or
        SIGTERM) is passed on again, so that each child hands its jobs back at once."""
        again = signum is not None and signum in self._signals
        if signum is not None:
            self._signals.add(signum)
        if self.stopping and not again:
            return
        self.stopping = True
        log.info("stopping worker processes now" if again else "stopping worker processes")
        for c in self.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)

    def run(self, early: list[int] | None = None) -> int:
        """`early`: the stop signals that came before this could take them (none started)."""
        # said here, after every check that refuses a start in one line has passed
        log.info(
            "starting worker processes",
            extra={"processes": len(self.children), "gpus": sorted({c.gpu for c in self.children})},
        )
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        for sig in early or []:
            self._stop(sig)
        return self.run_supervised()

    def run_supervised(self) -> int:
        """Start every child, keep them running until `_stop` or a crash loop, then wait for
        their drain; `CRASH_LOOP_EXIT` after a crash loop, else the worst child's exit code."""
        for c in self.children if not self.stopping else []:
            self._start(c)
        try:
            while not self.stopping:
                self._supervise(time.monotonic())
                self._report(time.monotonic())
                time.sleep(POLL_S)
            code = self._wait_all()
        finally:
            self._unreport()
        return CRASH_LOOP_EXIT if self.crash_loop is not None else code

    def _supervise(self, now: float) -> None:
        for c in self.children:
            if c.stopped_at is not None:
                continue
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
            if not self._may_restart(c, now):
                self._give_up(c, code)
                return
            c.restarts += 1
            c.recent_restarts.append(now)
            c.next_start = now + c.backoff
            log.warning(
                "worker process exited; restarting",
                extra={"child": c.name, "code": code, "in_s": c.backoff},
            )
            c.backoff = min(c.backoff * 2, RESTART_BACKOFF_MAX_S)

    def _may_restart(self, c: Child, now: float) -> bool:
        """Whether `c` has restarts left in the window that ends now."""
        while c.recent_restarts and c.recent_restarts[0] <= now - self.settings.restart_window_s:
            c.recent_restarts.popleft()
        return len(c.recent_restarts) < self.settings.restart_limit

    def _give_up(self, c: Child, code: int) -> None:
        """Stop restarting `c`; the others go on. None left: the launcher stops too."""
        c.stopped_at = time.time()
        self.crash_loop = self.crash_loop or c
        left = [o for o in self.children if o.stopped_at is None]
        log.error(
            "worker process keeps dying: stopped it; "
            + (f"{len(left)} other(s) go on" if left else "none is left"),
            extra={
                "child": c.name,
                "worker_id": c.env["GENQ_WORKER_ID"],
                "code": code,
                "restarts": len(c.recent_restarts),
                "window_s": self.settings.restart_window_s,
            },
        )
        self._reported_at = 0.0  # say so now
        if not left:
            self._stop()

    # ---- telling the gateways -------------------------------------------------------------

    def _report(self, now: float) -> None:
        """Every `STOPPED_REPORT_S`: the stopped children into Redis, for /readyz."""
        stopped = [c for c in self.children if c.stopped_at is not None]
        if not stopped or now - self._reported_at < STOPPED_REPORT_S:
            return
        self._reported_at = now
        until = time.time() + STOPPED_REPORT_TTL_S
        entries = {c.env["GENQ_WORKER_ID"]: self._entry(c, until).encode() for c in stopped}
        try:
            self._client().hset(Keys(self.settings.key_prefix).stopped_workers(), mapping=entries)
        except (RedisError, OSError, ValueError) as exc:  # told again at the next report
            log.warning("could not report stopped worker processes", extra={"error": str(exc)})

    def _entry(self, c: Child, until: float) -> StoppedWorker:
        window = self.settings.restart_window_s
        assert c.stopped_at is not None
        return StoppedWorker(
            worker_id=c.env["GENQ_WORKER_ID"],
            model=served_model(self.settings),
            gpu=c.gpu,
            host=socket.gethostname(),
            reason=f"died {len(c.exit_codes)} times, {self.settings.restart_limit} restarts "
            f"within {window:g} s (GENQ_RESTART_LIMIT): stopped by its launcher",
            exit_codes=c.exit_codes[-self.settings.restart_limit - 1 :],
            since=c.stopped_at,
            until=until,
        )

    def _unreport(self) -> None:
        """The launcher leaves: its stopped children are no longer its to report."""
        ids = [c.env["GENQ_WORKER_ID"] for c in self.children if c.stopped_at is not None]
        if not ids or self._redis is None:
            return
        try:
            self._redis.hdel(Keys(self.settings.key_prefix).stopped_workers(), *ids)
        except (RedisError, OSError):
            pass  # they lapse
        finally:
            self._redis.close()

    def _client(self) -> redis.Redis:
        if self._redis is None:
            self._redis = sync_client(self.settings)
        return self._redis

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


def sync_client(s: WorkerSettings) -> redis.Redis:
    """A plain (blocking) client of the workers' Redis, for the launcher's few writes: the
    URL's, the cluster's, else the master the sentinels name."""
    timeouts = {"socket_timeout": s.redis_socket_timeout_s}
    timeouts["socket_connect_timeout"] = s.redis_socket_timeout_s
    if s.redis_url:
        return redis.Redis.from_url(s.redis_url, **timeouts)
    if s.redis_cluster:  # the launcher's writes are single keys: any node routes them
        nodes = [ClusterNode(*sentinel_address(a)) for a in s.redis_cluster]
        return redis.RedisCluster(
            startup_nodes=nodes,
            username=s.redis_username,
            password=_secret(s.redis_password),
            ssl=s.redis_cluster_tls,
            **timeouts,
        )
    if not s.redis_sentinels or s.redis_sentinel_master is None:
        raise ValueError("no Redis to report to (GENQ_REDIS_URL, GENQ_REDIS_SENTINELS)")
    sentinel = Sentinel(
        [sentinel_address(a) for a in s.redis_sentinels],
        sentinel_kwargs={"password": _secret(s.redis_sentinel_password), **timeouts},
    )
    return sentinel.master_for(
        s.redis_sentinel_master,
        username=s.redis_username,
        password=_secret(s.redis_password),
        **timeouts,
    )


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value else None


def served_model(settings: WorkerSettings) -> str:
    """The model's name as its workers announce it: --model-name, else the folder's, else
    `sim`."""
    if settings.model_name:
        return settings.model_name
    return Path(settings.model_dir).name if settings.model_dir else "sim"


def cpu_sets_for(settings: WorkerSettings, placement: list[str]) -> list[list[int]] | None:
    """Each child's CPUs (`--cpu-affinity`): `auto` pins several exllamav2 processes, whose
    CPU work is what limits them; one process, or sim workers, are left to the scheduler."""
    mode = settings.cpu_affinity
    if mode == "off" or (mode == "auto" and (settings.engine != "exllamav2" or len(placement) < 2)):
        return None
    return cpus.plan_for_host(placement)


def parse_gpus(spec: str | None) -> list[str]:
    """'0,1' → ['0', '1']; none given: the visible GPUs as CUDA_VISIBLE_DEVICES names them,
    else GPU 0."""
    if spec:
        return [g.strip() for g in spec.split(",") if g.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g for g in visible.split(",") if g] if visible else ["0"]


def auto_procs(settings: WorkerSettings, gpus: list[str]) -> int:
    """Worker processes per GPU when none is given: one copy of the weights per process must
    fit beside the GPU's cache, each process wants CORES_PER_PROC cores, at most
    GENQ_AUTO_PROCS_MAX (the *_CPU_SAMPLING values with GPU sampling off). The sim engine, an
    unknown GPU or model: 1."""
    if settings.engine != "exllamav2" or not settings.model_dir:
        return 1
    free = gpu_share.gpu_memory(settings, gpus[0])
    try:
        size = gpu_share.model_size(Path(settings.model_dir))
    except (OSError, ValueError, KeyError):
        return 1
    if free is None or size.weights_bytes == 0:
        return 1
    per_token = size.kv_per_token * CACHE_BYTES_PER_ELEMENT[settings.cache_mode]
    cache = gpu_cache_tokens(settings) * per_token
    per_proc = size.weights_bytes + PROC_OVERHEAD_BYTES
    by_memory = int((free * GPU_MEMORY_USABLE - cache) // per_proc)
    most, cores = (
        (settings.auto_procs_max, CORES_PER_PROC)
        if settings.gpu_sampling
        else (AUTO_MAX_PROCS_CPU_SAMPLING, CORES_PER_PROC_CPU_SAMPLING)
    )
    by_cpu = (os.cpu_count() or 1) // (cores * len(gpus))
    return max(1, min(most, by_memory, by_cpu))


def resolve_procs(settings: WorkerSettings, gpus: list[str], spec: str | int | None) -> int:
    if spec is None or spec == "auto":
        return auto_procs(settings, gpus)
    return max(1, int(spec))


def run(
    settings: WorkerSettings,
    gpus: str | None,
    procs_per_gpu: str | int | None,
    early: list[int] | None = None,
) -> int:
    """Plan the GPUs' memory (SystemExit with one line where the processes do not fit),
    then start and supervise them; `early`: the stop signals that came before."""
    gpu_list = parse_gpus(gpus)
    procs = resolve_procs(settings, gpu_list, procs_per_gpu)
    memory = gpu_share.check_fits(settings, gpu_list, procs)
    return Launcher(settings, gpu_list, procs, memory=memory).run(early)
