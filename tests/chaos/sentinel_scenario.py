"""Scenario: SIGKILL the Redis master under load; the sentinels promote the replica.

A real `genq gateway` and two sim workers find Redis only through three sentinels. Streams
run and a burst of queued jobs is being submitted when the master dies; the scenario counts
what the clients were told (2xx = accepted) against what finished, and times the recovery.

A client here is the careful one of tests/chaos/harness.py: a POST that fails (5xx, a broken
connection) is sent again with the same Idempotency-Key, so it is either accepted once or
not at all, whichever Redis was answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.redisconn import connect
from shared.settings import RedisSettings
from tests.chaos.harness import (
    FAST_LEASES,
    Accepted,
    Reference,
    Stream,
    follow,
    stream_faults,
    submit,
    until,
)
from tests.chaos.sentinels import MASTER_NAME, SentinelGroup
from tests.procs import Cluster

PREFIX = "genqsentinel:"
KEYS = Keys(PREFIX)
STREAM_TOKENS = 150
"""Long enough that the streams are still under way when the master dies."""
QUEUED_TOKENS = 16
SUBMITTERS = 16
STEP_MS = 60
"""The streams then last 9 s: on a loaded 2-core host the steps before the kill (offsets, the
cut) took 3.3 s, and at 30 ms a stream was all but done by then."""
MAX_BATCH = 32
POLL_S = 0.02


@dataclass
class FailoverResult:
    wait_replicas: int
    queued: int
    streams: int
    accepted: int = 0
    completed: int = 0
    lost: list[str] = field(default_factory=list)
    """Accepted jobs the new master does not know."""
    stuck: list[str] = field(default_factory=list)
    """Accepted jobs it knows that did not end."""
    stream_faults: dict[str, list[str]] = field(default_factory=dict)
    submit_recovery_s: float | None = None
    """SIGKILL → the first 2xx of a submit sent after it."""
    stream_recovery_s: float | None = None
    """SIGKILL → the last of the streams under way at it to go on (`_resumed`)."""
    streams_across_kill: int = 0
    failover_s: float | None = None
    """SIGKILL → the sentinels name the new master."""
    repl_lag_bytes: int = 0
    """Master offset less the replica's just before the kill (an upper bound)."""
    elapsed_s: float = 0.0


@contextlib.contextmanager
def sentinel_cluster(group: SentinelGroup, tmp: Path, **env: str) -> Iterator[Cluster]:
    cluster = Cluster("", tmp, PREFIX, **FAST_LEASES, **group.env, **env)
    del cluster.env["GENQ_REDIS_URL"]  # the sentinels say where Redis is
    try:
        yield cluster
    finally:
        cluster.close()


def client_of(group: SentinelGroup) -> aioredis.Redis:
    """The test's own client: genq's, so it follows the failover as the processes do."""
    settings = RedisSettings(redis_sentinels=group.addresses, redis_sentinel_master=MASTER_NAME)
    return connect(settings)


async def failover(
    group: SentinelGroup,
    tmp: Path,
    *,
    wait_replicas: int,
    queued: int = 200,
    streams: int = 50,
    kill_after: int | None = None,
    stall_ms: int = 0,
    wait_timeout_ms: int | None = None,
    limit_s: float = 60.0,
) -> FailoverResult:
    """Kill the master once `kill_after` (default: a quarter) of the queued jobs are
    accepted; with `stall_ms`, the replication link breaks that long before (`_cut_replica`),
    so what the master acknowledges meanwhile is on the master only."""
    started = time.monotonic()
    result = FailoverResult(wait_replicas, queued, streams)
    env = {"GENQ_REDIS_WAIT_REPLICAS": str(wait_replicas)}
    if wait_timeout_ms is not None:
        env["GENQ_REDIS_WAIT_TIMEOUT_MS"] = str(wait_timeout_ms)
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0), limits=limits) as http,
        contextlib.aclosing(client_of(group)) as redis,
    ):
        with sentinel_cluster(group, tmp, **env) as cluster:
            gateway = cluster.gateway()
            for _ in range(2):
                cluster.worker("--step-ms", str(STEP_MS), "--max-batch", str(MAX_BATCH))

            async def both_workers_up() -> bool:  # else one runs its 32 streams alone, early
                return len([k async for k in redis.scan_iter(match=f"{PREFIX}worker:*")]) >= 2

            await until(both_workers_up, limit_s, "both workers up")
            watched = [Stream(_body(i, STREAM_TOKENS)) for i in range(streams)]
            followers = [
                asyncio.create_task(follow(http, lambda: [gateway.url], s)) for s in watched
            ]

            async def streaming() -> bool:
                return all(s.tokens() >= 3 for s in watched)

            await until(streaming, limit_s, "every stream under way")
            accepted, killed_at = await _submit_and_kill(
                http,
                gateway.url,
                group,
                result,
                (queued, kill_after or queued // 4),
                watched,
                stall_ms,
            )
            after = [a.at - killed_at for a in accepted if a.sent > killed_at]
            result.submit_recovery_s = min(after) if after else None
            await _settle(redis, result, accepted, limit_s)
            await asyncio.wait_for(asyncio.gather(*followers), limit_s)
            reference = Reference()
            for s in watched:
                ref = reference.text(s.body["prompt"], s.body["seed"], STREAM_TOKENS)
                if problems := stream_faults(s, ref, STREAM_TOKENS):
                    result.stream_faults[s.job_id or "?"] = problems
            resumed = [r for s in watched if (r := _resumed(s, killed_at)) is not None]
            result.stream_recovery_s = max(resumed) if resumed else None
            result.streams_across_kill = len(resumed)
    result.elapsed_s = time.monotonic() - started
    return result


async def _submit_and_kill(
    http: httpx.AsyncClient,
    url: str,
    group: SentinelGroup,
    result: FailoverResult,
    counts: tuple[int, int],
    streams: list[Stream],
    stall_ms: int,
) -> tuple[list[Accepted], float]:
    """Submit `queued` jobs; SIGKILL the master while they are still arriving (once
    `kill_after` are accepted) and the streams still under way (at the latest when one of
    them is half done: on a busy host the submits can be slow). The accepted jobs, and
    when the kill was."""
    queued, kill_after = counts
    gate = asyncio.Semaphore(SUBMITTERS)
    accepted: list[Accepted] = []
    enough = asyncio.Event()

    async def one(i: int) -> None:
        async with gate:
            accepted.append(await submit(http, url, _body(1000 + i, QUEUED_TOKENS, "batch")))
            if len(accepted) >= kill_after:
                enough.set()

    async def half_done() -> None:
        while max(s.tokens() for s in streams) < STREAM_TOKENS // 2:
            await asyncio.sleep(POLL_S)
        enough.set()

    submitters = asyncio.gather(*(one(i) for i in range(queued)))
    watcher = asyncio.create_task(half_done())
    await enough.wait()
    watcher.cancel()
    replica_at = await _offset(group.replica.port, "slave_repl_offset")
    if stall_ms:
        await _cut_replica(group, stall_ms)
    lag = await _offset(group.master.port, "master_repl_offset") - replica_at
    result.repl_lag_bytes = max(0, lag)  # replica read first: an upper bound
    group.master.kill()
    killed_at = time.monotonic()
    if stall_ms:
        group.replica.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    promoted = asyncio.create_task(_failover_time(group, killed_at))
    await submitters
    result.failover_s = await promoted
    result.accepted = len(accepted)
    return accepted, killed_at


async def _cut_replica(group: SentinelGroup, stall_ms: int) -> None:
    """The replica stops (SIGSTOP: it cannot reconnect) and the master drops its link
    (CLIENT KILL): what the master writes from now on stays in its backlog, as when a
    network partition cuts the replica off just before the master dies. SIGSTOP alone
    would not do: the kernel's socket buffers would hold the writes for the replica."""
    group.replica.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    async with aioredis.Redis(port=group.master.port) as m:
        await m.execute_command("CLIENT", "KILL", "TYPE", "replica")
    await asyncio.sleep(stall_ms / 1000)  # the fault's length, not a wait for an event


async def _offset(port: int, field: str) -> int:
    async with aioredis.Redis(port=port) as r:
        return int((await r.info("replication"))[field])


async def _failover_time(group: SentinelGroup, killed_at: float) -> float:
    async def promoted() -> bool:
        return await asyncio.to_thread(group.master_port) == group.replica.port

    await until(promoted, 30.0, "the sentinels to promote the replica")
    return time.monotonic() - killed_at


async def _settle(
    redis: aioredis.Redis, result: FailoverResult, accepted: list[Accepted], limit_s: float
) -> None:
    """Wait until every accepted job the new master knows has ended."""
    ids = [a.job_id for a in accepted]

    async def statuses() -> list[str | None]:
        pipe = redis.pipeline(transaction=False)
        for j in ids:
            pipe.hget(KEYS.job(j), "status")
        return list(await pipe.execute())

    async def ended() -> bool:
        return all(s in (None, "succeeded", "failed") for s in await statuses())

    with contextlib.suppress(TimeoutError):
        await until(ended, limit_s, "every accepted job to end", poll=0.25)
    final = await statuses()
    result.lost = [j for j, s in zip(ids, final, strict=True) if s is None]
    result.completed = sum(s == "succeeded" for s in final)
    result.stuck = [j for j, s in zip(ids, final, strict=True) if s not in (None, "succeeded")]


def _resumed(stream: Stream, killed_at: float) -> float | None:
    """When a stream under way at the kill went on, from the kill: the end of the longest
    pause between its events after the kill (those read just after it were written before
    it, waiting in buffers)."""
    before = [e for e in stream.events if e.at <= killed_at]
    after = [e for e in stream.events if e.at > killed_at]
    if not before or not after:
        return None
    times = [before[-1].at, *(e.at for e in after)]
    _, end = max((b - a, b) for a, b in itertools.pairwise(times))
    return end - killed_at


def _body(i: int, max_tokens: int, priority: str = "interactive") -> dict:
    return {
        "model": "sim",
        "prompt": f"job {i} the model",
        "seed": i,
        "max_tokens": max_tokens,
        "priority": priority,
    }
