"""Chaos scenarios as functions, so a test asserts on one run and the benchmark repeats it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx
import redis.asyncio as aioredis

from shared.keys import Keys
from tests.chaos.harness import (
    FAST_LEASES,
    Reference,
    Stream,
    follow,
    recovery_s,
    stream_faults,
    until,
)
from tests.procs import Cluster, Proc, RedisServer, redis_server

PREFIX = "genqchaos:"
# Every scenario's redis-server runs the shipped config (AOF, fsync every second, noeviction).
DEPLOY_REDIS_CONF = Path(__file__).resolve().parents[2] / "deploy" / "redis.conf"
KEYS = Keys(PREFIX)
STARTUP_S = 30.0


@dataclass
class Env:
    """A private redis-server and the genq processes of one scenario."""

    redis_server: RedisServer
    cluster: Cluster
    redis: aioredis.Redis
    http: httpx.AsyncClient

    def gateways(self) -> list[str]:
        return [p.url for p in self.cluster.procs if p.name == "gateway" and p.proc.poll() is None]

    def worker(self, *args: str, wait_model: str | None = "sim", **env: str) -> Proc:
        return self.cluster.worker(*args, wait_model=wait_model, **env)

    async def live_workers(self) -> int:
        return len([k async for k in self.redis.scan_iter(match=f"{PREFIX}worker:*")])

    async def wait_workers(self, n: int) -> None:
        async def enough() -> bool:
            return await self.live_workers() >= n

        await until(enough, STARTUP_S, f"{n} live workers")

    async def owner(self, job_id: str) -> str | None:
        return cast("str | None", await self.redis.hget(KEYS.job(job_id), "worker"))

    async def record(self, job_id: str) -> dict[str, str]:
        return cast("dict[str, str]", await self.redis.hgetall(KEYS.job(job_id)))

    async def log(self, job_id: str) -> list[dict]:
        entries = cast(
            "list[tuple[str, dict[str, str]]]", await self.redis.xrange(KEYS.events(job_id))
        )
        return [json.loads(f["d"]) for _, f in entries]

    async def dead_letters(self) -> list[str]:
        entries = cast(
            "list[tuple[str, dict[str, str]]]", await self.redis.xrange(KEYS.dead_letters())
        )
        return [f["job"] for _, f in entries]

    async def job_ids(self) -> list[str]:
        keys = cast("list[str]", await self.redis.keys(KEYS.job("*")))
        return [k.split("{")[1].rstrip("}") for k in keys]

    async def pending(self) -> int:
        total = 0
        for priority in ("interactive", "batch"):
            with contextlib.suppress(aioredis.ResponseError):
                info = await self.redis.xpending(KEYS.queue("sim", priority), "workers")
                total += int(info["pending"])
        return total

    def tail_logs(self, lines: int = 30) -> str:
        out = []
        for p in self.cluster.procs:
            if p.log.exists():
                tail = p.output().splitlines()[-lines:]
                out.append(f"--- {p.name} pid {p.proc.pid} rc {p.proc.poll()}\n" + "\n".join(tail))
        return "\n".join(out)


@contextlib.asynccontextmanager
async def chaos_env(tmp: Path, **env: str) -> AsyncIterator[Env]:
    with _cluster(tmp, {**FAST_LEASES, **env}) as (server, cluster):
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0), limits=limits)
        try:
            yield Env(server, cluster, client, http)
        finally:
            await http.aclose()
            await client.aclose()


@contextlib.contextmanager
def _cluster(tmp: Path, env: dict[str, str]) -> Iterator[tuple[RedisServer, Cluster]]:
    with redis_server(DEPLOY_REDIS_CONF) as server:
        cluster = Cluster(server.url, tmp, PREFIX, **env)
        try:
            yield server, cluster
        finally:
            cluster.close()


def worker_pid(worker_id: str) -> int:
    """Worker ids are `<host>-<pid>-<random>`."""
    return int(worker_id.rsplit("-", 2)[1])


def job_body(i: int, max_tokens: int, **extra: object) -> dict:
    prompt = f"job {i} the model"
    return {"model": "sim", "prompt": prompt, "seed": i, "max_tokens": max_tokens, **extra}


@dataclass
class KillResult:
    jobs: int
    moved: int
    """Jobs whose worker was killed."""
    lost: int
    duplicated: int
    wrong: int
    """Finished streams whose events or text are wrong in any other way."""
    recoveries: list[float]
    faults: dict[str, list[str]] = field(default_factory=dict)
    elapsed_s: float = 0.0


async def worker_kill(
    env: Env, *, jobs: int = 50, max_tokens: int = 60, step_ms: int = 50, limit_s: float = 60.0
) -> KillResult:
    """Scenario 1: two workers, `jobs` streaming seeded jobs; SIGKILL the worker holding most
    of them once every stream is under way; every stream must still end exactly right."""
    started = time.monotonic()
    if not env.gateways():
        env.cluster.gateway()
    workers = [env.worker("--step-ms", str(step_ms), "--max-batch", str(jobs)) for _ in range(2)]
    await env.wait_workers(2)
    reference = Reference()
    streams = [Stream(job_body(i, max_tokens)) for i in range(jobs)]
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def all_streaming() -> bool:
        return all(s.tokens() >= 3 for s in streams)

    await until(all_streaming, limit_s, "every stream to be under way")
    owners = Counter([await env.owner(s.job_id or "") for s in streams])
    victim_id, moved = owners.most_common(1)[0]
    victim = next(w for w in workers if w.proc.pid == worker_pid(victim_id or "0-0-0"))
    victim.kill()
    killed_at = time.monotonic()
    _, pending = await asyncio.wait(tasks, timeout=limit_s)
    for t in pending:
        t.cancel()
    faults: dict[str, list[str]] = {}
    lost = duplicated = wrong = 0
    for s in streams:
        if not s.finished:
            lost += 1
            continue
        seqs = [e.seq for e in s.events]
        dones = sum(e.type == "done" for e in s.events)
        dup = len(seqs) != len(set(seqs)) or dones > 1 or s.tokens() > max_tokens
        ref = reference.text(s.body["prompt"], s.body["seed"], max_tokens)
        problems = stream_faults(s, ref, max_tokens)
        if problems:
            faults[s.job_id or "?"] = problems
            if dup:
                duplicated += 1
            else:
                wrong += 1
    recoveries = [r for s in streams if (r := recovery_s(s, killed_at)) is not None]
    return KillResult(
        jobs=jobs,
        moved=moved,
        lost=lost,
        duplicated=duplicated,
        wrong=wrong,
        recoveries=recoveries,
        faults=faults,
        elapsed_s=time.monotonic() - started,
    )


async def statuses(env: Env, job_ids: list[str]) -> Counter[str]:
    pipe = env.redis.pipeline(transaction=False)
    for j in job_ids:
        pipe.hget(KEYS.job(j), "status")
    return Counter(await pipe.execute())


def sigstop(p: Proc) -> None:
    p.signal(signal.SIGSTOP)


def sigcont(p: Proc) -> None:
    p.signal(signal.SIGCONT)
