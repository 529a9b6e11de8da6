"""The engine process: a child of its worker, seen in `ps`, with no Redis connection of its
own. Killed (SIGKILL) or stalled (SIGSTOP) in the middle of streams, it is a worker failure
like a failed engine step: its jobs go back to the queue (the attempt counted), the worker
reports itself not ready while it restarts the engine, and every stream ends exactly right.
Killed again and again, it stops the worker (exit 1) as a failing engine always did."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil

from shared.schemas import Sampling
from tests.chaos.harness import Reference, Stream, follow, stream_faults, until
from tests.chaos.scenarios import KEYS, Env, job_body
from tests.procs import Proc, engine_processes, free_port
from worker.engine import EngineJob
from worker.sim import SimEngine, build_tokenizer

STEP_MS = "50"
JOBS, TOKENS = 8, 60
STOP_AT = 40
"""Outputs into a job its stop string begins (the kill comes within its first few)."""
TIMEOUT_S = 30.0
STALL_S = 1.0
STALL_SLACK_S = 1.5
"""Stall checks run every STALL_S / 4; the kill, reap and hand-back add a little."""
MAX_ENGINE_FAILURES = 5
"""worker/flush.py's limit of consecutive engine failures."""


def engines_of(worker: Proc) -> list[psutil.Process]:
    return engine_processes(worker.proc.pid)


def engine_of(worker: Proc) -> psutil.Process:
    [child] = engines_of(worker)
    return child


async def _beat(env: Env) -> dict[str, str]:
    [key] = [k async for k in env.redis.scan_iter(match=KEYS.worker("*"))]
    return await env.redis.hgetall(key)  # type: ignore[no-any-return]


async def _start(env: Env, **settings: str) -> tuple[Proc, str]:
    """A gateway and one worker (with its probe server); the worker and its probe URL."""
    env.cluster.gateway()
    port = free_port()
    probes = {"GENQ_METRICS_PORT": str(port), "GENQ_METRICS_HOST": "127.0.0.1"}
    worker = env.worker("--step-ms", STEP_MS, **probes, **settings)
    await env.wait_workers(1)
    return worker, f"http://127.0.0.1:{port}"


def _pieces(body: dict) -> list[str]:
    """The text of each output of an undisturbed run of this job (the sim engine's own)."""
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0)
    ids = build_tokenizer().encode(body["prompt"], add_special_tokens=False).ids
    sampling = Sampling(seed=body["seed"], stop=body.get("stop", []))
    engine.add(EngineJob("ref", ids, body["max_tokens"], sampling, body["seed"]))
    out: list[str] = []
    while engine.active():
        out += [o.text for o in engine.step()]
    return out


async def _streams_under_way(
    env: Env, bodies: list[dict] | None = None
) -> tuple[list[Stream], list[asyncio.Task[Stream]]]:
    bodies = bodies or [job_body(i, TOKENS) for i in range(JOBS)]
    streams = [Stream(b) for b in bodies]
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def streaming() -> bool:
        return all(s.tokens() >= 3 for s in streams)

    await until(streaming, TIMEOUT_S, "every stream under way")
    return streams, tasks


async def _all_exact(env: Env, streams: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
    reference = Reference()
    for s in streams:
        want = reference.text(s.body["prompt"], s.body["seed"], TOKENS)
        assert not stream_faults(s, want, TOKENS)
        record = await env.record(s.job_id or "")
        assert record["status"] == "succeeded"
        assert record["attempt"] == "2", "the engine's failure counts as an attempt"


async def _not_ready_then_ready(probes: str, what: str) -> None:
    async def not_ready() -> bool:
        r = await httpx.AsyncClient().get(f"{probes}/readyz")
        return r.status_code == 503 and what in r.json()["reason"]

    async def ready() -> bool:
        return (await httpx.AsyncClient().get(f"{probes}/readyz")).status_code == 200

    await until(not_ready, TIMEOUT_S, f"readiness to report the engine {what}", poll=0.01)
    await until(ready, TIMEOUT_S, "readiness back once the engine restarted")


async def test_the_engine_runs_in_a_child_process_without_redis(env: Env) -> None:
    worker, _ = await _start(env)
    engine = engine_of(worker)
    assert ["-m", "worker.engine_process"] == engine.cmdline()[1:3]
    assert int((await _beat(env))["engine_pid"]) == engine.pid
    redis_port = env.redis_server.port
    assert not [c for c in engine.net_connections() if c.raddr and c.raddr[1] == redis_port]
    assert [c for c in psutil.Process(worker.proc.pid).net_connections() if c.raddr]


async def test_sigkill_the_engine_process_mid_stream(env: Env) -> None:
    worker, probes = await _start(env)
    streams, tasks = await _streams_under_way(env)
    engine = engine_of(worker)
    engine.send_signal(signal.SIGKILL)
    await _not_ready_then_ready(probes, "was killed by SIGKILL")
    await _all_exact(env, streams, tasks)
    beat = await _beat(env)
    assert beat["engine_restarts"] == "1" and "engine_down" not in beat
    assert engine_of(worker).pid == int(beat["engine_pid"]) != engine.pid
    assert worker.proc.poll() is None


async def test_worker_made_text_resumes_exactly_across_an_engine_death(env: Env) -> None:
    """GENQ_DETOKENIZE=worker: the I/O process makes the text and matches stop strings; a
    stop string past the resume point is still found, and every stream is the reference's."""
    worker, probes = await _start(env, GENQ_DETOKENIZE="worker")
    bodies = [job_body(i, TOKENS) for i in range(JOBS)]
    for body in bodies[::2]:  # half of them end on a stop string well after the kill
        pieces = _pieces(body)
        body["stop"] = [pieces[STOP_AT] + pieces[STOP_AT + 1][:2]]
    streams, tasks = await _streams_under_way(env, bodies)
    engine_of(worker).send_signal(signal.SIGKILL)
    await _not_ready_then_ready(probes, "was killed by SIGKILL")
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
    for s in streams:
        want = "".join(_pieces(s.body))
        if "stop" in s.body:
            done = s.events[-1]
            assert done.type == "done" and done.data["finish_reason"] == "stop"
            assert s.text == want and s.body["stop"][0] not in s.text
        else:
            assert not stream_faults(s, want, TOKENS)
        assert (await env.record(s.job_id or ""))["attempt"] == "2"


async def test_a_stalled_engine_process_is_killed_and_restarted(env: Env) -> None:
    worker, probes = await _start(env, GENQ_ENGINE_STALL_S=str(STALL_S))
    streams, tasks = await _streams_under_way(env)
    engine = engine_of(worker)
    engine.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    await _not_ready_then_ready(probes, "stalled")
    await until(
        lambda: asyncio.to_thread(lambda: not psutil.pid_exists(engine.pid)),
        TIMEOUT_S,
        "the stalled engine process to be gone",
    )
    await _all_exact(env, streams, tasks)
    first_resumed = min(
        e.at for s in streams for e in s.events if e.type == "token" and e.data["attempt"] == 2
    )
    assert first_resumed - stopped_at < STALL_S + STALL_SLACK_S + 2.0  # restarted and resumed
    assert "stalled" in worker.output()


async def test_an_engine_that_keeps_dying_stops_the_worker(env: Env) -> None:
    worker, _ = await _start(env)
    for n in range(MAX_ENGINE_FAILURES):
        killed = engine_of(worker).pid
        os.kill(killed, signal.SIGKILL)
        if n < MAX_ENGINE_FAILURES - 1:

            async def replaced(old: int = killed) -> bool:
                pids = [e.pid for e in await asyncio.to_thread(engines_of, worker)]
                return pids not in ([], [old])

            await until(replaced, TIMEOUT_S, "a new engine process")
    rc = await asyncio.to_thread(worker.proc.wait, TIMEOUT_S)
    assert rc == 1, "a crash loop is the supervisor's to see"
    assert "engine keeps failing" in worker.output()
