"""GPU benchmark: the bare generator in-process vs the whole genq system, same workload.

    python -m genq.benchgpu --model DIR [--engine exllamav2|exllamav3] [--streams 64]
        [--sweep 1,8,64,128,256] [--bare] [--system] [--new-tokens 256]
        [--worker-arg=--procs-per-gpu=2 ...] [--sampler-probe] [--json-out FILE]

Workload: `streams` closed-loop clients, each running jobs back to back (like `genq bench`);
every job has a prompt of random token ids, uniform in [prompt-min, prompt-max], and asks
for `new-tokens` tokens with neutral sampling (temperature 1). `--bare` feeds the same jobs
straight into the engine's generator (exllamav2's `ExLlamaV2DynamicGenerator`, or exllamav3's
`Generator` with the `ComboSampler` genq gives each job), loaded once for every level;
`--system` (the default when neither is given) sends them over HTTP (`genq.bench.Client`,
the client `genq bench` uses) to `genq gateway` processes, with `genq worker --engine ENGINE`
behind Redis. Levels: `--sweep`, else `--streams`. Figures per level: tokens/s, time to
first token and inter-token latency p50/p99 (each token event's gap divided among its
tokens), and the system/bare ratio where both ran.

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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from genq import procstats
from genq.bench import Client, Target
from genq.stats import TokenTimes, latency
from shared.keys import Keys
from shared.logs import setup as setup_logging
from shared.schemas import Sampling
from shared.settings import Settings

VOCAB_LOW = 300
"""Lowest token id used in prompts: above the special tokens of a synth model."""
READY_TIMEOUT_S = 600.0
REQUESTS_PER_STREAM = 2
SIM = "sim"
"""`--model sim`: the system path with the sim engine, to try the harness without a GPU."""
SIM_VOCAB = 500
TERMINATED = 143
"""Exit status after SIGTERM (128 + 15), as if the signal had ended the process."""


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


def summary(label: str, streams: int, traces: list[TokenTimes], wall: float, **extra: Any) -> dict:
    tokens = sum(t.tokens for t in traces)
    return {
        "run": label,
        "streams": streams,
        "jobs": len(traces),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        **latency(traces, LATENCY_DIGITS),
        **extra,
    }


# ---- bare generator -------------------------------------------------------------------------


def load_backend(settings: Settings) -> Any:
    if settings.engine == "exllamav3":
        from worker.exl3.loader import load_backend as load_exl3

        return load_exl3(settings)
    from worker.exl2.loader import load_backend as load_exl2

    return load_exl2(settings)


def run_bare(
    backend: Any, gen: Any, card: Any, jobs: list[Job], streams: int, probe: bool = False
) -> dict:
    """The generator alone: enqueue `streams` jobs, start the next as each ends."""
    todo = list(reversed(jobs))
    traces: dict[int, TokenTimes] = {}
    sampling = Sampling()
    steps = 0

    def start() -> None:
        job = todo.pop()
        key = len(traces)
        handle = backend.make_job(
            job.ids, job.new_tokens, sampling, job.seed, list(card.eos_token_ids), str(key)
        )
        traces[key] = TokenTimes(time.perf_counter())
        gen.enqueue(handle)

    timer = SamplerTimer() if probe else contextlib.nullcontext()
    t0 = time.perf_counter()
    with timer:
        for _ in range(min(streams, len(todo))):
            start()
        while gen.num_remaining_jobs():
            results = gen.iterate()
            steps += 1
            now = time.perf_counter()
            for r in results:
                if r.get("stage") != "streaming":
                    continue
                ids = r.get("token_ids")
                traces[int(r["identifier"])].arrived(now, 0 if ids is None else int(ids.shape[-1]))
                if r.get("eos") and todo:
                    start()
    wall = time.perf_counter() - t0
    extra = timer.report(wall, steps) if isinstance(timer, SamplerTimer) else {}
    return summary("bare generator", streams, list(traces.values()), wall, **extra)


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
        return {
            "steps": steps,
            "step_ms": round(wall / max(steps, 1) * 1000, 3),
            "sampler_launch_ms_per_step": round(self.seconds / max(steps, 1) * 1000, 3),
            "sampler_launch_share": round(self.seconds / wall, 4) if wall else None,
            "sampler_calls": self.calls,
        }


def run_bare_levels(
    settings: Settings, levels: list[int], jobs_for: Any, probe: bool
) -> list[dict]:
    """Load the engine's backend once; the bare loop at each level; free the GPU after."""
    backend, card, _ = load_backend(settings)
    gen = backend.make_generator()
    try:
        return [run_bare(backend, gen, card, jobs_for(n), n, probe) for n in levels]
    finally:
        backend.close()
        import torch

        torch.cuda.empty_cache()


# ---- the whole system -----------------------------------------------------------------------


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
    ) -> None:
        self.model = model
        self.port = 18000 + os.getpid() % 1000
        self.logs = logs
        prefix = f"genqbench{int(time.time())}:"
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

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


async def drive_http(
    url: str, model: str, jobs: list[Job], streams: int
) -> tuple[list[TokenTimes], float]:
    target = Target("127.0.0.1", int(url.rsplit(":", 1)[1]), None)
    todo = iter(jobs)
    traces: list[TokenTimes] = []

    async def client_loop() -> None:
        client = Client(target)
        for job in todo:
            body = json.dumps(
                {
                    "model": model,
                    "input_ids": job.ids,
                    "max_tokens": job.new_tokens,
                    "stream": True,
                    "seed": job.seed,
                }
            ).encode()
            res = await client.stream_job(body)
            if not res.ok:
                raise RuntimeError(f"job failed: {res.error}")
            traces.append(res.times)
        await client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(streams, len(jobs)))))
    return traces, time.perf_counter() - t0


def run_system(system: System, jobs: list[Job], streams: int, label: str) -> dict:
    before = system.per_worker()
    cpu = CpuUse(system)
    traces, wall = asyncio.run(drive_http(system.url, system.model.name, jobs, streams))
    cores = cpu.cores(wall)
    after = system.per_worker()
    shares = {
        w: {k: v[k] - before.get(w, {}).get(k, 0) for k in v} for w, v in sorted(after.items())
    }
    return summary(label, streams, traces, wall, per_worker=list(shares.values()), cpu=cores)


class CpuUse:
    """CPU the parts of the system use during one level, in cores (CPU seconds / wall): the
    gateway processes, each worker process, redis-server, this load generator; and the host's
    CPUs, for scale."""

    def __init__(self, system: System) -> None:
        gateway, worker = (p.pid for p in system.procs)
        self.groups = {"gateway": procstats.process_tree(gateway)}
        workers = procstats.process_tree(worker)  # the launcher, then the processes it started
        if len(workers) > 1:
            self.groups["launcher"] = workers[:1]
        for i, pid in enumerate(workers[1:] or workers):
            self.groups[f"worker{i}"] = [pid]
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


def genq_bench(system: System, streams: int, requests: int, new: int, prompt: int) -> dict:
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
    a = _parser().parse_args(argv)
    # `timeout` ends a run with SIGTERM: leave through `finally`, which stops the gateway and
    # worker processes (left running, they would hold the GPU for the next run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(TERMINATED))
    model = Path(a.model)
    vocab = SIM_VOCAB if a.model == SIM else _vocab(model)
    levels = [int(x) for x in a.sweep.split(",") if x] or [a.streams]
    max_batch = a.max_batch or max(levels)
    cache = a.cache_tokens or max_batch * (a.prompt_max + a.new_tokens)
    settings = Settings(
        engine=a.engine,
        model_dir=str(model),
        max_batch=max_batch,
        cache_tokens=cache,
        gpu_sampling=not a.cpu_sampling,
    )
    setup_logging(settings)  # the processes it starts are `genq` commands: they set up their own
    common = {"engine": SIM if a.model == SIM else a.engine, "sampling": _sampling_label(a)}
    worker_args = ["--max-batch", str(max_batch), "--cache-tokens", str(cache), *a.worker_arg]
    results: list[dict] = []

    def report(r: dict) -> None:
        results.append(r)
        print(json.dumps(r), flush=True)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(results, indent=1))

    def jobs_for(streams: int) -> list[Job]:
        n = max(streams * a.requests_per_stream, 4)
        return workload(n, a.prompt_min, a.prompt_max, a.new_tokens, vocab)

    bare: dict[int, dict] = {}
    if a.bare:
        for r in run_bare_levels(settings, levels, jobs_for, a.sampler_probe):
            bare[r["streams"]] = r
            report(r | {"max_batch": max_batch, "cache_tokens": cache} | common)
    if a.system or not a.bare:
        logs = Path(a.logs)
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(kv.split("=", 1) for kv in a.worker_env)
        if a.cpu_sampling:
            env["GENQ_GPU_SAMPLING"] = "false"
        system = System(model, worker_args, a.gateways, logs, env, a.engine)
        try:
            system.wait_ready(a.workers)
            warm = workload(a.workers * 2, a.prompt_min, a.prompt_max, 8, vocab)
            run_system(system, warm, len(warm), "warm-up")
            extra = {"worker_args": " ".join(worker_args), "gateways": a.gateways, "env": env}
            for c in levels:
                print(f"# starting {c} streams", file=sys.stderr, flush=True)
                report(run_system(system, jobs_for(c), c, "system") | extra | common)
                if c in bare:
                    report(ratio(bare[c], results[-1]) | common)
            if a.genq_bench:
                mid = (a.prompt_min + a.prompt_max) // 2
                n = levels[-1]
                report(genq_bench(system, n, n * a.requests_per_stream, a.new_tokens, mid))
        finally:
            system.close()
    return 0


def _parser() -> argparse.ArgumentParser:
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
    p.add_argument("--max-batch", type=int, help="default: the largest level")
    p.add_argument("--cache-tokens", type=int, help="default: max-batch * (prompt-max + new)")
    p.add_argument("--bare", action="store_true", help="the bare generator at each level")
    p.add_argument("--system", action="store_true", help="the system at each level (default)")
    p.add_argument("--sweep", default="", help="levels, e.g. 1,8,64 (default: --streams)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra `genq worker` flag")
    p.add_argument("--worker-env", action="append", default=[], help="K=V for the processes")
    p.add_argument("--workers", type=int, default=1, help="worker processes to wait for")
    p.add_argument("--gateways", type=int, default=1, help="gateway (uvicorn) processes")
    p.add_argument("--genq-bench", action="store_true", help="also run the `genq bench` command")
    p.add_argument(
        "--cpu-sampling",
        action="store_true",
        help="exllamav2: its CPU sampler (GENQ_GPU_SAMPLING=false), not genq's GPU sampling",
    )
    p.add_argument(
        "--sampler-probe",
        action="store_true",
        help="exllamav3, bare: time spent launching the jobs' samplers each step",
    )
    p.add_argument("--logs", default="/tmp/genq-bench-logs")
    p.add_argument("--json-out")
    return p


def _sampling_label(a: argparse.Namespace) -> str:
    if a.engine == "exllamav3":
        return "exllamav3 ComboSampler (GPU)"
    return "cpu" if a.cpu_sampling else "gpu"


def ratio(bare: dict, system: dict) -> dict:
    return {
        "run": "ratio system/bare",
        "streams": system["streams"],
        "tokens_per_s": round(system["tokens_per_s"] / bare["tokens_per_s"], 3),
        "decode_rate_p50": _ratio(bare["itl_ms_p50"], system["itl_ms_p50"]),
        "ttft_p50_overhead_ms": round(system["ttft_ms_p50"] - bare["ttft_ms_p50"], 1),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b (a per-stream decode rate ratio from two inter-token latencies); None without both."""
    return round(a / b, 3) if a and b else None


def _vocab(model: Path) -> int:
    """Ids usable in prompts: below both the model's and the tokenizer's vocabulary."""
    from tokenizers import Tokenizer

    config = json.loads((model / "config.json").read_text())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return min(int(config["vocab_size"]), int(tok.get_vocab_size()))


if __name__ == "__main__":
    sys.exit(main())
