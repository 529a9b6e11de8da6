"""GPU benchmark: the bare generator in-process vs the whole genq system, same workload.

    python -m genq.benchgpu --model DIR [--engine exllamav2|exllamav3] [--streams 64]
        [--new-tokens 256] [--bare] [--system] [--sweep 1,8,32,64,128,256]
        [--compare 1,8,64,128] [--worker-arg=--procs-per-gpu=2 ...]
        [--worker-env GENQ_DETOKENIZE=worker ...] [--sampler-probe] [--json-out FILE]
        [--rounds 3 [--replay] [--ab-worker-env GENQ_X=Y ...]] [--bare-again] [--bare-load 4]
        [--pin-engine] [--schema-compare 1,64,256] [--min-tokens-compare 64,256 [--rounds 2]]
        [--first-burst 64,128]

Workload: `streams` closed-loop clients, each running jobs back to back (like `genq bench`);
every job has a prompt of random token ids, uniform in [prompt-min, prompt-max], and asks
for `new-tokens` tokens with neutral sampling (temperature 1). The bare run feeds the same
jobs straight into the engine's generator (exllamav2's `ExLlamaV2DynamicGenerator`, or
exllamav3's `Generator` with the `ComboSampler` genq gives each job); the system run sends them
over HTTP (`genq.bench.Client`, the client `genq bench` uses) to `genq gateway` processes, with
`genq worker --engine ENGINE` behind Redis. Figures: tokens/s, time to first token and
inter-token latency p50/p99 (each token event's gap divided among its tokens), per-stream decode
rate p50, and step times: the bare loop's `iterate()` (and its whole loop), and for the
system, from the workers' heartbeats, the engine's own step in its engine process beside the
step as the worker's I/O process receives them (the difference is the boundary's cost).
`--compare` runs the bare generator and then the system at each level in one call and
reports their ratios. A GPU host drifts by tens of percent within minutes, so `--rounds R`
keeps both loaded and lets them take turns at each level (the first to go flipping each
round): a ratio per turn and the median of the rounds; with `--replay` each bare turn takes its
jobs when the system's last turn sent them rather than all at once; with `--ab-worker-env` a
second system with those settings takes its turns too (an option against the defaults under
the same drift: `ratio alt/system` per round and its median). `--bare-again`,
`--bare-load N` and `--pin-engine` tell what slows the engine's step (the host's other
processes, the core it runs on).

`--schema-compare LEVELS`: one system, and at each level the same jobs unconstrained and all
under one JSON schema (`BENCH_SCHEMA`: ten properties, checked by the gateway once and cached,
as by the worker), taking turns (who goes first moving each round of `--rounds`, default
one): a `ratio schema/plain` row per turn (tokens/s and decode rate as a share of the
unconstrained run's, TTFT p50 difference) and the medians per level. `--min-tokens-compare
LEVELS` does the same with every job's `min_tokens` set to its `max_tokens` (`ratio
min_tokens/plain`); given both, the three variants take their turns on one system.

`--first-burst LEVELS`: at each level, a freshly loaded bare loop's first run of that many
jobs, all at once, against a freshly started system's first burst of the same jobs (no
request before it: what the worker's own warm-up at start leaves): tokens/s and TTFT p50 of
each, and their `ratio system/bare, first burst`.

Engine settings come from GENQ_* as for a worker (e.g. GENQ_PREFILL_COOLDOWN=4 for both the
bare loop and the worker). `--sampler-probe` (exllamav3, bare): how long each step spends
launching the jobs' samplers, i.e. what sampling all rows in one batched pass could save.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from genq import procstats
from genq.bench import Client, Target
from genq.stats import TokenTimes, latency, percentile
from shared import lifeline
from shared.keys import Keys
from shared.logs import setup as setup_logging
from shared.schemas import Sampling
from shared.settings import Settings

WARM_UP_TOKENS = 8
"""New tokens of each warm-up job (a variant's min_tokens is cut to it)."""
VOCAB_LOW = 300
"""Lowest token id used in prompts: above the special tokens of a synth model."""
READY_TIMEOUT_S = 600.0
SETTLE_S = 5.0
SETTLE_POLL_S = 1.1
"""A little over a worker's heartbeat interval: its counters are as fresh as its last beat."""
REQUESTS_PER_STREAM = 2
SIM = "sim"
"""`--model sim`: the system path with the sim engine, to try the harness without a GPU."""
SIM_VOCAB = 500
ENGINE_MODULE = "worker.engine_process"
"""How a worker's engine process shows in its command line."""
TERMINATED = 143
"""Exit status after SIGTERM (128 + 15), as if the signal had ended the process."""


BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999_999},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "active": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b", "c", "red", "green"]},
            "maxItems": 5,
        },
        "category": {"enum": ["book", "film", "music", "game"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 30},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "body": {"type": "string", "minLength": 3000},
    },
    "required": [
        "id",
        "name",
        "email",
        "active",
        "score",
        "tags",
        "category",
        "address",
        "rating",
        "body",
    ],
    "additionalProperties": False,
}
"""`--schema-compare`'s schema: every kind of JSON value, the short ones bounded, so that a
random-weight model (which picks among the allowed tokens almost uniformly) walks through all
ten properties in its first ~100 tokens and then writes the long `body`: a job runs to its
`--new-tokens`, as the unconstrained one does, instead of ending early or spending its tokens
on the digits of an unbounded number."""


@dataclass
class Job:
    ids: list[int]
    new_tokens: int
    seed: int


def workload(n: int, prompt_min: int, prompt_max: int, new_tokens: int, vocab: int) -> list[Job]:
    rng = random.Random(0)
    return [
        Job(
            [rng.randrange(VOCAB_LOW, vocab) for _ in range(rng.randint(prompt_min, prompt_max))],
            new_tokens,
            i,
        )
        for i in range(n)
    ]


LATENCY_DIGITS = 1
"""Milliseconds are reported to this many decimals."""


def summary(
    label: str, streams: int, traces: list[TokenTimes], wall: float, **extra: Any
) -> dict[str, Any]:
    tokens = sum(t.tokens for t in traces)
    steps = extra.get("steps")
    return {
        "run": label,
        "streams": streams,
        "jobs": len(traces),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        **latency(traces, LATENCY_DIGITS),
        "decode_tok_s_p50": decode_rate_p50(traces),
        # the mean batch a step decoded: below the bare loop's, jobs waited to start
        "tokens_per_step": round(tokens / steps, 1) if steps else None,
        **extra,
    }


def decode_rate_p50(traces: list[TokenTimes]) -> float | None:
    """Per-stream decode rate (tokens after the first / time from first to last), median over
    the streams: what one user sees once the reply has begun."""
    rates = [
        (t.tokens - 1) / (t.last - t.first)
        for t in traces
        if t.first is not None and t.last is not None and t.last > t.first
    ]
    p50 = percentile(rates, 50)
    return None if p50 is None else round(p50, 1)


# ---- bare generator -------------------------------------------------------------------------


BATCHED_ENV = "GENQ_BATCHED_SAMPLING"


def stock_unless_asked(settings: Settings, environ: dict[str, str] | os._Environ[str]) -> Settings:
    """The bare exllamav3 loop samples each job with exllamav3's own sampler (the stock loop
    the worker is measured against), whatever the worker's default; `GENQ_BATCHED_SAMPLING` in
    benchgpu's own environment gives it genq's batched pass too."""
    if BATCHED_ENV in environ:
        return settings
    return settings.model_copy(update={"batched_sampling": False})


def load_backend(settings: Settings) -> Any:
    if settings.engine == "exllamav3":
        from worker.exl3.loader import load_backend as load_exl3

        return load_exl3(settings)
    from worker.exl2.loader import load_backend as load_exl2

    return load_exl2(settings)


class Bare:
    """The engine's generator loop in this process, genq's loader and sampler (as the
    worker's), loaded once for every level it runs."""

    def __init__(self, settings: Settings, probe: bool = False) -> None:
        self.backend, self.card, _ = load_backend(settings)
        self.probe = probe

    def close(self) -> None:
        self.backend.close()
        import torch

        torch.cuda.empty_cache()

    def run(
        self, jobs: list[Job], streams: int, arrivals: list[float] | None = None
    ) -> dict[str, Any]:
        """Enqueue `streams` jobs, start the next as each ends (a job arrives when enqueued);
        or, given `arrivals` (seconds from the start, one per job), each job at its time, as
        the system's clients sent them."""
        gen = self.backend.make_generator()
        traces: dict[int, TokenTimes] = {}
        sampling = Sampling()
        stops = list(self.card.eos_token_ids)
        # the jobs still to start, the next last
        todo = sorted(range(len(jobs)), key=lambda i: (arrivals[i], i) if arrivals else (0.0, i))
        todo.reverse()

        def start() -> None:
            i = todo.pop()
            job = jobs[i]
            handle = self.backend.make_job(
                job.ids, job.new_tokens, sampling, job.seed, stops, str(i)
            )
            traces[i] = TokenTimes(time.perf_counter())
            gen.enqueue(handle)

        steps, step_s = 0, 0.0
        timer = SamplerTimer() if self.probe else contextlib.nullcontext()
        t0 = time.perf_counter()
        with timer:
            if arrivals is None:
                for _ in range(min(streams, len(todo))):
                    start()
            while todo or gen.num_remaining_jobs():
                if arrivals is not None:
                    while todo and arrivals[todo[-1]] <= time.perf_counter() - t0:
                        start()
                    if not gen.num_remaining_jobs():
                        time.sleep(max(0.0, arrivals[todo[-1]] - (time.perf_counter() - t0)))
                        continue
                t = time.perf_counter()
                results = gen.iterate()
                now = time.perf_counter()
                steps, step_s = steps + 1, step_s + now - t
                for r in results:
                    if r.get("stage") != "streaming":
                        continue
                    ids = r.get("token_ids")
                    n = 0 if ids is None else int(ids.shape[-1])
                    traces[int(r["identifier"])].arrived(now, n)
                    if r.get("eos") and arrivals is None and todo:
                        start()
        wall = time.perf_counter() - t0
        extra = timer.report(wall, steps) if isinstance(timer, SamplerTimer) else {}
        batched: Any = getattr(gen, "genq_sampler", None)
        if hasattr(batched, "batched_tokens"):  # exllamav3's GENQ_BATCHED_SAMPLING
            extra |= {
                "batched_tokens": batched.batched_tokens,
                "batched_pass_ms_per_step": round(batched.seconds / max(steps, 1) * 1000, 3),
            }
        return summary(
            "bare generator" if arrivals is None else "bare generator, the system's arrivals",
            streams,
            list(traces.values()),
            wall,
            steps=steps,
            step_ms=round(step_s / max(steps, 1) * 1000, 3),
            loop_ms=round(wall / max(steps, 1) * 1000, 3),
            **extra,
        )


class SamplerTimer:
    """exllamav3 samples each job on the GPU with kernels of its own, launched job by job
    from Python (`Job.receive_logits`) after each forward pass; the time spent launching them
    is what one batched sampling pass over all rows could save."""

    def __enter__(self) -> SamplerTimer:
        from exllamav3.generator.job import Job

        self.job_cls = Job
        self.original = Job.receive_logits
        self.seconds = 0.0
        self.calls = 0
        original = self.original

        def timed(job: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(job, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        Job.receive_logits = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self.job_cls.receive_logits = self.original

    def report(self, wall: float, steps: int) -> dict[str, Any]:
        """The sampler's figures, beside the row's own (steps, step_ms)."""
        return {
            "sampler_launch_ms_per_step": round(self.seconds / max(steps, 1) * 1000, 3),
            "sampler_launch_share": round(self.seconds / wall, 4) if wall else None,
            "sampler_calls": self.calls,
        }


def run_bare(settings: Settings, jobs: list[Job], streams: int) -> dict[str, Any]:
    bare = Bare(settings)
    try:
        return bare.run(jobs, streams)
    finally:
        bare.close()


# ---- the whole system -----------------------------------------------------------------------


CLEANUP_BATCH = 1000
"""Keys deleted per DEL when a run cleans up."""


class System:
    """`genq gateway` + `genq worker` processes on the Redis of GENQ_REDIS_URL."""

    def __init__(
        self,
        model: Path,
        worker_args: list[str],
        gateways: int,
        logs: Path,
        env: dict[str, str] | None = None,
        engine: str = "exllamav2",
        index: int = 0,
    ) -> None:
        """`index`: which of the systems one benchmark runs side by side (its port and keys)."""
        self.model = model
        self.port = 18000 + 1000 * index + os.getpid() % 1000
        self.logs = logs
        prefix = f"genqbench{int(time.time())}-{index}:"
        self.keys = Keys(prefix)
        url = os.environ.get("GENQ_REDIS_URL", "redis://127.0.0.1:6379/0")
        self.redis = redis.Redis.from_url(url, decode_responses=True)
        self.env = {
            **os.environ,
            "GENQ_REDIS_URL": url,
            "GENQ_KEY_PREFIX": prefix,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self._spawn("gateway", ["gateway", "--port", str(self.port), "--workers", str(gateways)])
        serve = (
            ["--engine", "sim"]
            if model.name == SIM
            else ["--engine", engine, "--model", str(model)]
        )
        self._spawn("worker", ["worker", *serve, *worker_args])

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # the child writes to it
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "genq", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=lifeline.preexec(),  # a killed benchmark leaves no service running
            )
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, workers: int = 1) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args!r} exited with {p.returncode}; see {self.logs}")
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=2).json()["data"]
                if any(m["id"] == self.model.name for m in models) and self.workers() >= workers:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise TimeoutError("system did not come up")

    def workers(self) -> int:
        return int(self.redis.zcard(self.keys.workers()))

    def per_worker(self) -> dict[str, dict[str, int]]:
        """Jobs and tokens each worker process generated (job records name their worker)."""
        out: dict[str, dict[str, int]] = {}
        for key in self.redis.scan_iter(match=self.keys.job("*"), count=1000):
            worker, usage = self.redis.hmget(key, ["worker", "usage"])
            if not worker:
                continue
            w = out.setdefault(worker, {"jobs": 0, "tokens": 0})
            w["jobs"] += 1
            with contextlib.suppress(ValueError, TypeError):
                w["tokens"] += int(json.loads(usage)["completion_tokens"])
        return out

    def step_counters(self) -> StepCounters:
        """Every live worker's cumulative engine step counters (heartbeats), summed."""
        total = StepCounters()
        for key in self.redis.scan_iter(match=self.keys.worker("*"), count=1000):
            beat = self.redis.hgetall(key)
            with contextlib.suppress(KeyError, ValueError):
                total = total.plus(
                    StepCounters(
                        int(beat["steps"]),
                        float(beat["engine_step_s"]),
                        int(beat["worker_steps"]),
                        float(beat["worker_step_s"]),
                    )
                )
        return total

    def settled_counters(self) -> StepCounters:
        """The counters once every engine is idle and two heartbeats agree."""
        last = self.step_counters()
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)
            now = self.step_counters()
            if now == last:
                break
            last = now
        return last

    def close(self) -> None:
        """Stop the processes, then remove the run's keys: a benchmark leaves nothing in the
        Redis it was pointed at."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        with contextlib.suppress(redis.RedisError, OSError):
            keys = list(self.redis.scan_iter(match=f"{self.keys.prefix}*", count=1000))
            for i in range(0, len(keys), CLEANUP_BATCH):
                self.redis.delete(*keys[i : i + CLEANUP_BATCH])


async def drive_http(
    url: str,
    model: str,
    jobs: list[Job],
    streams: int,
    sent: dict[int, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[list[TokenTimes], float]:
    """Stream `jobs` through `streams` clients; `sent` gets each job's send time (seconds from
    the start, by the job's index); `extra`: more fields for every job (a constraint)."""
    target = Target("127.0.0.1", int(url.rsplit(":", 1)[1]), None)
    todo = iter(enumerate(jobs))
    traces: list[TokenTimes] = []

    async def client_loop() -> None:
        client = Client(target)
        for i, job in todo:
            body = json.dumps(
                {
                    "model": model,
                    "input_ids": job.ids,
                    "max_tokens": job.new_tokens,
                    "stream": True,
                    "seed": job.seed,
                    **(extra or {}),
                }
            ).encode()
            res = await client.stream_job(body)
            if not res.ok:
                raise RuntimeError(f"job failed: {res.error}")
            traces.append(res.times)
            if sent is not None:
                sent[i] = res.times.start - t0
        await client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(streams, len(jobs)))))
    return traces, time.perf_counter() - t0


def run_system(
    system: System,
    jobs: list[Job],
    streams: int,
    label: str,
    sent: dict[int, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    before = system.per_worker()
    counters = system.settled_counters()
    cpu = CpuUse(system)
    drive = drive_http(system.url, system.model.name, jobs, streams, sent, extra)
    traces, wall = asyncio.run(drive)
    cores = cpu.cores(wall)
    after = system.per_worker()
    shares = {
        w: {k: v[k] - before.get(w, {}).get(k, 0) for k in v} for w, v in sorted(after.items())
    }
    steps = system.settled_counters().minus(counters)
    return summary(
        label,
        streams,
        traces,
        wall,
        **steps.figures(),
        per_worker=list(shares.values()),
        cpu=cores,
    )


@dataclass(frozen=True)
class StepCounters:
    """The heartbeat's cumulative engine step counters (worker/upkeep.py)."""

    steps: int = 0
    engine_s: float = 0.0
    worker_steps: int = 0
    worker_s: float = 0.0

    def plus(self, o: StepCounters) -> StepCounters:
        return StepCounters(*(a + b for a, b in zip(astuple(self), astuple(o), strict=True)))

    def minus(self, o: StepCounters) -> StepCounters:
        return StepCounters(*(a - b for a, b in zip(astuple(self), astuple(o), strict=True)))

    def figures(self) -> dict[str, float | int | None]:
        """Steps, and per step: the engine's own step time in its process, and the time from
        one step's outputs to the next's as the worker received them."""
        return {
            "steps": self.steps,
            "engine_step_ms": _per_ms(self.engine_s, self.steps),
            "worker_step_ms": _per_ms(self.worker_s, self.worker_steps),
        }


def _per_ms(seconds: float, n: int) -> float | None:
    return round(seconds / n * 1000, 3) if n else None


class CpuUse:
    """CPU the parts of the system use during one level, in cores (CPU seconds / wall): the
    gateway processes, each worker process and its engine process, redis-server, this load
    generator; and the host's CPUs, for scale."""

    def __init__(self, system: System) -> None:
        gateway, worker = (p.pid for p in system.procs)
        self.groups = {"gateway": procstats.process_tree(gateway)}
        # The launcher (with several processes), the worker processes, their engine processes.
        tree = procstats.process_tree(worker)
        engines = [p for p in tree if ENGINE_MODULE in procstats.command_line(p)]
        workers = [p for p in tree if p not in engines]
        if len(workers) > 1:
            self.groups["launcher"] = workers[:1]
            workers = workers[1:]
        for i, pid in enumerate(workers):
            self.groups[f"worker{i}"] = [pid]
        for i, pid in enumerate(engines):
            self.groups[f"engine{i}"] = [pid]
        self.groups["redis"] = procstats.pids_named("redis-server")
        self.groups["bench"] = [os.getpid()]
        self.before = {g: procstats.total_cpu_seconds(p) for g, p in self.groups.items()}

    def cores(self, wall: float) -> dict[str, float]:
        out = {
            g: (procstats.total_cpu_seconds(p) - self.before[g]) / wall
            for g, p in self.groups.items()
        }
        out = {g: round(v, 2) for g, v in out.items()}
        out["total"] = round(sum(out.values()), 2)
        out["host_cpus"] = os.cpu_count() or 0
        return out


def genq_bench(
    system: System, streams: int, requests: int, new: int, prompt: int
) -> dict[str, Any]:
    """The `genq bench` command itself (fixed prompt length), for the record."""
    cmd = [
        sys.executable,
        "-m",
        "genq",
        "bench",
        "--url",
        system.url,
        "--model",
        system.model.name,
        "--concurrency",
        str(streams),
        "--requests",
        str(requests),
        "--max-tokens",
        str(new),
        "--prompt-tokens",
        str(prompt),
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=system.env, check=False)
    lines = out.stdout.strip().splitlines()
    return {
        "run": "genq bench",
        "cmd": " ".join(cmd[1:]),
        **(json.loads(lines[-1]) if lines else {"stderr": out.stderr[-2000:]}),
    }


# ---- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # `timeout` ends a run with SIGTERM: leave through `finally`, which stops the gateway and
    # worker processes (left running, they would hold the GPU for the next run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(TERMINATED))
    run = prepare(a)
    if run.first_burst:
        first_bursts(run)
        return 0
    if run.schema or run.min_tokens:
        variant_turns(run)
        return 0
    if a.rounds and run.compare and a.model != SIM:
        run_turns(run)
        return 0
    bare = bare_first(run)
    if a.system or run.levels or run.compare:
        system_runs(run)
    if bare is not None:  # --bare-again: the bare loop once more, after the system
        bare_after(run, bare)
    return 0


# ---- parse ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m genq.benchgpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--engine", choices=["exllamav2", "exllamav3"], default="exllamav2")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--requests-per-stream", type=int, default=REQUESTS_PER_STREAM)
    p.add_argument("--max-batch", type=int, help="default: --streams")
    p.add_argument("--cache-tokens", type=int, help="default: max-batch * (prompt-max + new)")
    p.add_argument("--bare", action="store_true")
    p.add_argument("--system", action="store_true")
    p.add_argument("--sweep", default="", help="concurrency levels for the system, e.g. 1,8,64")
    p.add_argument(
        "--compare",
        default="",
        help="levels to run the bare generator at, then the system, in this one call, with a "
        "ratio row for each, e.g. 1,8,64,128 (needs a GPU model; the system only with sim)",
    )
    p.add_argument(
        "--schema-compare",
        default="",
        help="levels at which the same jobs run unconstrained and all under one JSON schema "
        "(BENCH_SCHEMA), taking turns (--rounds, default 1), e.g. 1,64,256: the system only",
    )
    p.add_argument(
        "--min-tokens-compare",
        default="",
        help="levels at which the same jobs run without and with min_tokens = max_tokens, "
        "taking turns (--rounds, default 1; with --schema-compare, the three on one system)",
    )
    p.add_argument(
        "--first-burst",
        default="",
        help="levels at which a fresh bare loop's first burst and a fresh system's first burst "
        "of the same jobs compare (each level: both loaded anew), e.g. 64,128",
    )
    p.add_argument("--worker-arg", action="append", default=[], help="extra `genq worker` flag")
    p.add_argument("--worker-env", action="append", default=[], help="K=V for the processes")
    p.add_argument("--workers", type=int, default=1, help="worker processes to wait for")
    p.add_argument("--gateways", type=int, default=1, help="gateway (uvicorn) processes")
    p.add_argument("--genq-bench", action="store_true", help="also run the `genq bench` command")
    _add_diagnostics(p)
    p.add_argument("--logs", default="/tmp/genq-bench-logs")
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    if a.ab_worker_env and not (a.rounds and a.compare):
        p.error("--ab-worker-env takes its turns with --compare LEVELS --rounds R")
    return a


def _add_diagnostics(p: argparse.ArgumentParser) -> None:
    """The flags of the diagnostics behind docs/performance.md: samplers, CPUs, drift."""
    p.add_argument(
        "--cpu-sampling",
        action="store_true",
        help="exllamav2's CPU sampler (GENQ_GPU_SAMPLING=false), not genq's GPU sampling",
    )
    p.add_argument(
        "--sampler-probe",
        action="store_true",
        help="exllamav3, bare: time spent launching the jobs' samplers each step",
    )
    p.add_argument(
        "--pin-engine",
        action="store_true",
        help="give the engine a core of its own: the bare loop and the worker's engine process "
        "(GENQ_ENGINE_CPUS) on one CPU of the host's last core, everything else off that core",
    )
    p.add_argument(
        "--bare-load",
        type=int,
        default=0,
        help="with --compare: run the bare loop once more at each level with N busy processes "
        "beside it (is the step bound by a CPU the rest of the host slows?)",
    )
    p.add_argument(
        "--bare-again",
        action="store_true",
        help="with --compare: run the bare loop again after the system (kept loaded meanwhile), "
        "so each ratio has a bare figure before and after it; then once more with each job "
        "arriving when the system's client sent it (the bare loop takes jobs as they arrive)",
    )
    _add_turn_flags(p)


def _add_turn_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="with --compare: both loaded at once, the bare loop and the system take turns at "
        "each level, this many rounds; ratios per round and their median (a GPU host drifts "
        "by tens of percent within minutes: turns keep the two under the same drift)",
    )
    p.add_argument(
        "--ab-worker-env",
        action="append",
        default=[],
        help="with --rounds: K=V for a second system's processes, on top of --worker-env; it "
        "takes its turns beside the first (ratio rows alt/bare and alt/system): an option "
        "against the defaults under the same drift",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="with --rounds: the bare loop takes each job when the system's last turn at that "
        "level sent it, instead of all at once (the system goes first in round 0)",
    )


# ---- prepare --------------------------------------------------------------------------------


@dataclass
class BenchRun:
    """One call's plan (from its flags) and what its phases measured, level by level."""

    a: argparse.Namespace
    model: Path
    vocab: int
    levels: list[int]
    """--sweep"""
    compare: list[int]
    schema: list[int]
    """--schema-compare"""
    min_tokens: list[int]
    """--min-tokens-compare"""
    first_burst: list[int]
    """--first-burst"""
    max_batch: int
    cache: int
    settings: Settings
    sampling: dict[str, str]
    """Every row's labels: the engine and where it samples (and the pinned CPU)."""
    worker_args: list[str]
    pin: EnginePin | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    bare_at: dict[int, dict[str, Any]] = field(default_factory=dict)
    system_at: dict[int, dict[str, Any]] = field(default_factory=dict)
    sent_at: dict[int, list[float]] = field(default_factory=dict)
    """When the system's client sent each job, by level: the bare loop's replayed arrivals."""

    def report(self, r: dict[str, Any]) -> None:
        """Print a row (one JSON line) and keep it; rewrite --json-out with every row so far."""
        self.results.append(r)
        print(json.dumps(r), flush=True)
        if self.a.json_out:
            Path(self.a.json_out).write_text(json.dumps(self.results, indent=1))

    def jobs_for(self, streams: int) -> list[Job]:
        n = max(streams * self.a.requests_per_stream, 4)
        return workload(n, self.a.prompt_min, self.a.prompt_max, self.a.new_tokens, self.vocab)

    def on_engine(self) -> contextlib.AbstractContextManager[None]:
        """The bare loop on the engine's CPU with --pin-engine; else as it is."""
        return self.pin.on_engine() if self.pin else contextlib.nullcontext()

    def worker_env(self) -> dict[str, str]:
        env = dict(kv.split("=", 1) for kv in self.a.worker_env)
        if self.a.cpu_sampling:
            env["GENQ_GPU_SAMPLING"] = "false"
        return env


def prepare(a: argparse.Namespace) -> BenchRun:
    """The model's vocabulary, the batch and cache sizes every run shares, the engine
    settings (GENQ_* on top), logging, and the engine's CPU with --pin-engine."""
    model = Path(a.model)
    vocab = SIM_VOCAB if a.model == SIM else _vocab(model)
    levels = [int(x) for x in a.sweep.split(",") if x]
    compare = [int(x) for x in a.compare.split(",") if x]
    schema = [int(x) for x in a.schema_compare.split(",") if x]
    min_tokens = [int(x) for x in a.min_tokens_compare.split(",") if x]
    burst = [int(x) for x in a.first_burst.split(",") if x]
    max_batch = a.max_batch or max([a.streams, *levels, *compare, *schema, *min_tokens, *burst])
    cache = a.cache_tokens or max_batch * (a.prompt_max + a.new_tokens)
    settings = Settings(
        engine=a.engine,
        model_dir=str(model),
        max_batch=max_batch,
        cache_tokens=cache,
        gpu_sampling=not a.cpu_sampling,
    )
    settings = stock_unless_asked(settings, os.environ)
    setup_logging(settings)  # the processes it starts are `genq` commands: they set up their own
    sampling = {
        "engine": SIM if a.model == SIM else a.engine,
        "sampling": "cpu" if a.cpu_sampling else "gpu",
    }
    worker_args = ["--max-batch", str(max_batch), "--cache-tokens", str(cache), *a.worker_arg]
    run = BenchRun(
        a,
        model,
        vocab,
        levels,
        compare,
        schema,
        min_tokens,
        burst,
        max_batch,
        cache,
        settings,
        sampling,
        worker_args,
    )
    run.pin = EnginePin.for_host() if a.pin_engine else None
    if run.pin is not None:
        sampling["engine_cpu"] = str(run.pin.engine)
    return run


# ---- run: turns, the bare loop, the system --------------------------------------------------


def run_turns(run: BenchRun) -> None:
    """--compare --rounds: the bare loop and the system, both loaded, take turns."""
    a = run.a
    alt = dict(kv.split("=", 1) for kv in a.ab_worker_env)
    turns = Turns(
        run.settings,
        run.model,
        run.worker_args,
        a.gateways,
        Path(a.logs),
        run.worker_env(),
        a.engine,
        alt,
        run.pin,
    )
    try:
        turns.run(run.compare, a.rounds, run.jobs_for, run.report, run.sampling, a.replay)
    finally:
        turns.close()


def variants(run: BenchRun, level: int) -> dict[str, dict[str, Any] | None]:
    """The request fields each variant adds to every job at `level` ("plain": none)."""
    out: dict[str, dict[str, Any] | None] = {"plain": None}
    if level in run.schema:
        out["schema"] = {"json_schema": BENCH_SCHEMA}
    if level in run.min_tokens:
        out["min_tokens"] = {"min_tokens": run.a.new_tokens}
    return out


def variant_turns(run: BenchRun) -> None:
    """--schema-compare, --min-tokens-compare: one system; at each level the same jobs plain
    and as each variant asks take turns, who goes first moving each round and level; a ratio
    row per variant and turn, the medians per level. Every variant warms up first (the
    schema's check and compiled grammar cached, as for any schema seen before)."""
    a = run.a
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    env = run.worker_env()
    system = System(run.model, run.worker_args, a.gateways, logs, env, a.engine)
    levels = sorted(set(run.schema) | set(run.min_tokens))
    extra = {"worker_args": " ".join(run.worker_args), "gateways": a.gateways, **run.sampling}
    try:
        system.wait_ready(a.workers)
        warm = workload(a.workers * 2, a.prompt_min, a.prompt_max, WARM_UP_TOKENS, run.vocab)
        seen: dict[str, dict[str, Any] | None] = {}
        for c in levels:
            seen |= variants(run, c)
        for body in seen.values():  # a minimum no larger than the warm-up's jobs
            if body and "min_tokens" in body:
                body = {**body, "min_tokens": WARM_UP_TOKENS}
            run_system(system, warm, len(warm), "warm-up", extra=body)
        ratios: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for r in range(max(a.rounds, 1)):
            for i, c in enumerate(levels):
                turns = variants(run, c)
                names = list(turns)
                shift = (r + i) % len(names)
                rows = {}
                for who in names[shift:] + names[:shift]:
                    print(f"# round {r}: {who} at {c} streams", file=sys.stderr, flush=True)
                    row = run_system(system, run.jobs_for(c), c, f"system, {who}", None, turns[who])
                    rows[who] = row | extra | {"round": r}
                    run.report(rows[who])
                for who in names[1:]:
                    kind = f"{who}/plain"
                    row = ratio(rows["plain"], rows[who], kind) | {"round": r}
                    ratios.setdefault((c, kind), []).append(row)
                    run.report(row)
        for (c, kind), rows_of in ratios.items():
            run.report(median_ratio(c, rows_of, kind))
    finally:
        system.close()


def first_bursts(run: BenchRun) -> None:
    """--first-burst: at each level a freshly loaded bare loop runs its first burst of that
    many jobs (all enqueued at once), then a freshly started system its first burst of the
    same jobs (all sent at once, nothing before them: the worker's own warm-up at start is
    all it has had); each is closed before the next starts."""
    a = run.a
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    env = run.worker_env()
    extra = {"worker_args": " ".join(run.worker_args), "gateways": a.gateways, **run.sampling}
    for c in run.first_burst:
        jobs = workload(c, a.prompt_min, a.prompt_max, a.new_tokens, run.vocab)
        print(f"# bare generator, first burst of {c}", file=sys.stderr, flush=True)
        bare = Bare(run.settings)
        try:
            row = bare.run(jobs, c) | run.sampling | {"run": "bare generator, first burst"}
        finally:
            bare.close()
        run.report(row)
        print(f"# system, first burst of {c}", file=sys.stderr, flush=True)
        system = System(run.model, run.worker_args, a.gateways, logs, env, a.engine)
        try:
            system.wait_ready(a.workers)
            mine = run_system(system, jobs, c, "system, first burst") | extra
        finally:
            system.close()
        run.report(mine)
        run.report(ratio(row, mine, "system/bare, first burst"))


def bare_first(run: BenchRun) -> Bare | None:
    """The bare generator at --streams (--bare) and at each --compare level (with a GPU
    model), before the system; with --bare-load once more beside busy processes. Returns
    the loaded loop with --bare-again (for `bare_after`), else closes it."""
    a = run.a
    if not (a.bare or (run.compare and a.model != SIM)):
        return None
    bare = Bare(run.settings, a.sampler_probe)
    try:
        for c in ([a.streams] if a.bare else []) + run.compare:
            print(f"# bare generator at {c} streams", file=sys.stderr, flush=True)
            with run.on_engine():
                row = bare.run(run.jobs_for(c), c)
            row |= {"max_batch": run.max_batch, "cache_tokens": run.cache}
            run.bare_at.setdefault(c, row)
            run.report(row | run.sampling)
            if a.bare_load and c in run.compare:
                with run.on_engine(), Busy(a.bare_load):
                    loaded = bare.run(run.jobs_for(c), c)
                run.report(loaded | run.sampling | {"run": f"bare generator, {a.bare_load} busy"})
    finally:
        if not a.bare_again:
            bare.close()
    return bare if a.bare_again else None


def system_runs(run: BenchRun) -> None:
    """The whole system (gateways and workers) at --streams (--system), each --sweep level and
    each --compare level, with a ratio row against the bare loop's where there is one; then
    `genq bench` (--genq-bench)."""
    a = run.a
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    env = run.worker_env()
    if run.pin is not None:
        env["GENQ_ENGINE_CPUS"] = str(run.pin.engine)
        run.pin.off_engine()  # this load client and every process it starts
    system = System(run.model, run.worker_args, a.gateways, logs, env, a.engine)
    try:
        system.wait_ready(a.workers)
        warm = workload(a.workers * 2, a.prompt_min, a.prompt_max, WARM_UP_TOKENS, run.vocab)
        run_system(system, warm, len(warm), "warm-up")
        extra = {
            "worker_args": " ".join(run.worker_args),
            "gateways": a.gateways,
            "env": env,
            **run.sampling,
        }
        _system_levels(run, system, extra)
        if a.genq_bench:
            mid = (a.prompt_min + a.prompt_max) // 2
            requests = a.streams * a.requests_per_stream
            run.report(genq_bench(system, a.streams, requests, a.new_tokens, mid))
    finally:
        system.close()


def _system_levels(run: BenchRun, system: System, extra: dict[str, Any]) -> None:
    a = run.a
    runs = [(a.streams, "system")] if a.system else []
    runs += [(c, "system sweep") for c in run.levels]
    runs += [(c, "system compare") for c in run.compare]
    for c, label in runs:
        print(f"# starting {c} streams", file=sys.stderr, flush=True)
        sent: dict[int, float] = {}
        row = run_system(system, run.jobs_for(c), c, label, sent) | extra
        run.report(row)
        if label != "system sweep" and c in run.bare_at:
            run.report(ratio(run.bare_at[c], row))
            run.system_at.setdefault(c, row)
            run.sent_at.setdefault(c, [sent[i] for i in range(len(sent))])


def bare_after(run: BenchRun, bare: Bare) -> None:
    """--bare-again: the bare loop at each --compare level after the system, and once more
    with each job arriving when the system's client sent it; a ratio row for each."""
    try:
        for c in run.compare:
            print(f"# bare generator again at {c} streams", file=sys.stderr, flush=True)
            with run.on_engine():
                row = bare.run(run.jobs_for(c), c)
            run.report(row | run.sampling | {"run": "bare generator, after the system"})
            if c in run.system_at:
                run.report(ratio(row, run.system_at[c]) | {"run": "ratio system/bare after"})
            if c in run.sent_at:  # the same jobs, each when the system's client sent it
                with run.on_engine():
                    row = bare.run(run.jobs_for(c), c, run.sent_at[c])
                run.report(row | run.sampling)
                same = {"run": "ratio system/bare, same arrivals"}
                run.report(ratio(row, run.system_at[c]) | same)
    finally:
        bare.close()


class Turns:
    """`--compare L --rounds R`: the bare loop and the system, both loaded, take turns at each
    level of L, R rounds; a ratio row per turn and one with the medians per level.

    `alt_env` (`--ab-worker-env`): a second system, its workers with those settings on top,
    takes its turns too, so an option is measured against the defaults under the same drift:
    each round `ratio alt/bare` beside `ratio system/bare` (the same bare turn) and `ratio
    alt/system`, and their medians."""

    alt: System | None = None
    alt_env: dict[str, str] | None = None
    pin: EnginePin | None = None

    def __init__(
        self,
        settings: Settings,
        model: Path,
        worker_args: list[str],
        gateways: int,
        logs: Path,
        env: dict[str, str],
        engine: str,
        alt_env: dict[str, str] | None = None,
        pin: EnginePin | None = None,
    ) -> None:
        self.bare = Bare(settings)
        self.system: System | None = None
        self.alt_env = alt_env
        self.pin = pin
        logs.mkdir(parents=True, exist_ok=True)
        if pin is not None:  # each worker's engine on the pin's CPU, the rest off it
            env = {**env, "GENQ_ENGINE_CPUS": str(pin.engine)}
            pin.off_engine()  # this process's other threads and every process it starts
        try:
            self.system = System(model, worker_args, gateways, logs, env, engine)
            if alt_env:
                (logs / "alt").mkdir(exist_ok=True)
                alt = {**env, **alt_env}
                self.alt = System(model, worker_args, gateways, logs / "alt", alt, engine, 1)
                self.alt.wait_ready()
            self.system.wait_ready()
        except BaseException:
            self.close()
            raise
        self.extra = {"worker_args": " ".join(worker_args), "gateways": gateways, "env": env}

    def run(
        self,
        levels: list[int],
        rounds: int,
        jobs_for: Any,
        report: Any,
        sampling: dict[str, str],
        replay: bool = False,
    ) -> None:
        """`replay`: each bare turn takes its jobs as the system's last turn at that level
        sent them (the bare loop takes jobs as they arrive), not all at once."""
        assert self.system is not None
        systems = {"system": self.system} | ({"alt": self.alt} if self.alt else {})
        warm = workload(2, 64, 128, 8, _vocab(self.system.model))
        for system in systems.values():
            run_system(system, warm, len(warm), "warm-up")
        self.bare.run(warm, len(warm))
        turns = ["bare", *systems]
        kinds = ["system/bare"] + (["alt/bare", "alt/system"] if self.alt else [])
        ratios: dict[tuple[int, str], list[dict[str, Any]]] = {
            (c, k): [] for c in levels for k in kinds
        }
        sent_at: dict[int, list[float]] = {}
        for r in range(rounds):
            for c in levels:
                # the order turns each round: none always runs first or after the same one
                # (with `replay`, the system goes first in round 0: the bare loop needs its
                # arrivals)
                shift = (r + replay) % len(turns)
                order = turns[shift:] + turns[:shift]
                rows: dict[str, dict[str, Any]] = {}
                for who in order:
                    print(f"# round {r}: {who} at {c} streams", file=sys.stderr, flush=True)
                    if who == "bare":
                        arrivals = sent_at.get(c) if replay else None
                        with self.pin.on_engine() if self.pin else contextlib.nullcontext():
                            rows[who] = self.bare.run(jobs_for(c), c, arrivals)
                    else:
                        label = "system compare" if who == "system" else "alt compare"
                        sent: dict[int, float] = {}
                        row = run_system(systems[who], jobs_for(c), c, label, sent)
                        rows[who] = row | self.extra
                        if who == "alt":
                            rows[who]["alt_env"] = self.alt_env
                        else:
                            sent_at[c] = [sent[i] for i in range(len(sent))]
                    report(rows[who] | sampling | {"round": r})
                for kind in kinds:
                    top, under = kind.split("/")
                    row = ratio(rows[under], rows[top], kind) | {"round": r}
                    ratios[c, kind].append(row)
                    report(row)
        for c in levels:
            for kind in kinds:
                report(median_ratio(c, ratios[c, kind], kind))

    def close(self) -> None:
        for system in (self.system, self.alt):
            if system is not None:
                system.close()
        self.system = self.alt = None
        self.bare.close()


def median_ratio(
    streams: int, rows: list[dict[str, Any]], kind: str = "system/bare"
) -> dict[str, Any]:
    """The median over the rounds of each ratio figure, with its range."""

    def med(key: str) -> dict[str, float | None]:
        xs = sorted(x for r in rows if (x := r.get(key)) is not None)
        if not xs:
            return {"median": None, "min": None, "max": None}
        return {"median": round(statistics.median(xs), 3), "min": xs[0], "max": xs[-1]}

    return {
        "run": f"ratio {kind}, median of the rounds",
        "streams": streams,
        "rounds": len(rows),
        "tokens_per_s": med("tokens_per_s"),
        "decode_tok_s_p50": med("decode_tok_s_p50"),
        "ttft_p50_overhead_ms": med("ttft_p50_overhead_ms"),
        "ttft_p99_overhead_ms": med("ttft_p99_overhead_ms"),
    }


class EnginePin:
    """`--pin-engine`: one CPU for the engine (the host's last physical core, its siblings
    left idle), the rest for everything else."""

    def __init__(self, engine: int, rest: list[int]) -> None:
        self.engine = engine
        self.rest = rest

    @classmethod
    def for_host(cls) -> EnginePin | None:
        from worker.cpus import host_cores

        cores = host_cores(os.sched_getaffinity(0))
        if len(cores) < 2:
            return None
        last = cores[-1].cpus
        return cls(last[0], sorted(c for core in cores[:-1] for c in core.cpus))

    @contextlib.contextmanager
    def on_engine(self) -> Iterator[None]:
        """This thread (the bare loop) on the engine's CPU meanwhile."""
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, [self.engine])
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    def off_engine(self) -> None:
        os.sched_setaffinity(0, self.rest)


class Busy:
    """N processes spinning on a CPU each, for as long as the block runs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Busy:
        spin = "while True: pass"
        self.procs = [
            subprocess.Popen([sys.executable, "-c", spin], preexec_fn=lifeline.preexec())
            for _ in range(self.n)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def ratio(
    bare: dict[str, Any], system: dict[str, Any], kind: str = "system/bare"
) -> dict[str, Any]:
    """The system against the bare loop at one level: tokens/s and per-stream decode rate as a
    share of the bare generator's (≥ 0.97), time to first token p50 over it; the engine's step
    in the worker's engine process and as the worker sees it, beside the bare loop's. `kind`
    "alt/system": `bare` is the defaults' system row (its engine step under `bare`)."""

    def share(key: str) -> float | None:
        b, s = bare.get(key), system.get(key)
        return round(s / b, 3) if b and s is not None else None

    return {
        "run": f"ratio {kind}",
        "streams": system["streams"],
        "tokens_per_s": share("tokens_per_s"),
        "decode_tok_s_p50": share("decode_tok_s_p50"),
        "ttft_p50_overhead_ms": round(system["ttft_ms_p50"] - bare["ttft_ms_p50"], 1),
        "ttft_p99_overhead_ms": _difference(system.get("ttft_ms_p99"), bare.get("ttft_ms_p99")),
        "step_ms": {
            "bare": bare.get("step_ms", bare.get("engine_step_ms")),
            "bare_loop": bare.get("loop_ms"),
            "engine": system.get("engine_step_ms"),
            "worker": system.get("worker_step_ms"),
        },
        "tokens_per_step": {
            "bare": bare.get("tokens_per_step"),
            "system": system.get("tokens_per_step"),
        },
    }


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 1)


def _vocab(model: Path) -> int:
    """Ids usable in prompts: below both the model's and the tokenizer's vocabulary."""
    from tokenizers import Tokenizer

    config = json.loads((model / "config.json").read_text())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return min(int(config["vocab_size"]), int(tok.get_vocab_size()))


if __name__ == "__main__":
    sys.exit(main())
