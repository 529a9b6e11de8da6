"""Scenario 5: SIGTERM drains. A busy worker stops claiming, finishes what it can within its
grace period, hands the rest back at once (not after the lease), deletes its heartbeat and
exits 0; nothing is lost. A gateway finishes its open streams and exits 0; a stream whose job
outlasts the grace ends with a `server_stopping` end before its connection closes."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import psutil

from tests.chaos.harness import Reference, Stream, follow, stream_faults, until
from tests.chaos.scenarios import KEYS, Env, job_body, worker_pid
from tests.procs import engine_processes

GRACE_S = 2.0
LEASE_S = "5"  # long, so a job resumed quickly was handed back, not reclaimed after the lease
EXIT_SLACK_S = 2.0
SHORT, LONG = 15, 100  # tokens: at 50 ms a step, one finishes within the grace, one cannot
JOBS = 12
TIMEOUT_S = 30.0


async def test_sigterm_worker_finishes_or_hands_back_and_exits_0(env: Env) -> None:
    env.cluster.gateway()
    slow = {"GENQ_SHUTDOWN_GRACE_S": str(GRACE_S), "GENQ_LEASE_S": LEASE_S}
    busy = env.worker("--step-ms", "50", **slow)
    await env.wait_workers(1)
    bodies = [job_body(i, SHORT if i % 2 else LONG) for i in range(JOBS)]
    streams = [Stream(b) for b in bodies]
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def streaming() -> bool:
        return all(s.tokens() >= 3 for s in streams)

    await until(streaming, TIMEOUT_S, "every stream under way")
    busy_id = await env.owner(streams[0].job_id or "")
    assert busy_id is not None and worker_pid(busy_id) == busy.proc.pid
    [engine] = engine_processes(busy.proc.pid)
    env.worker("--step-ms", "50", wait_model=None, **slow)
    await env.wait_workers(2)
    busy.signal(signal.SIGTERM)
    termed_at = time.monotonic()
    rc = await asyncio.to_thread(busy.proc.wait, GRACE_S + EXIT_SLACK_S)
    assert rc == 0
    assert time.monotonic() - termed_at < GRACE_S + EXIT_SLACK_S
    assert not await env.redis.exists(KEYS.worker(busy_id))
    assert not psutil.pid_exists(engine.pid), "the engine process outlived its worker"
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    reference = Reference()
    for s in streams:
        n = s.body["max_tokens"]
        assert not stream_faults(s, reference.text(s.body["prompt"], s.body["seed"], n), n)
        record = await env.record(s.job_id or "")
        if n == SHORT:  # finished within the grace, on the draining worker
            assert record["worker"] == busy_id and record["attempt"] == "1"
        else:  # handed back: resumed at once elsewhere, and the hand-back cost no attempt
            assert record["attempt"] == "2" and record["handbacks"] == "1"
            resumed = next(e for e in s.events if e.type == "token" and e.data["attempt"] == 2)
            assert resumed.at - termed_at < GRACE_S + EXIT_SLACK_S
    assert await env.pending() == 0


async def test_sigterm_gateway_finishes_open_streams_and_exits_0(env: Env) -> None:
    gateway = env.cluster.gateway(GENQ_SHUTDOWN_GRACE_S="10")
    env.worker("--step-ms", "50")
    streams = [Stream(job_body(i, 40)) for i in range(3)]
    only_this = [gateway.url]
    tasks = [asyncio.create_task(follow(env.http, lambda: only_this, s)) for s in streams]

    async def streaming() -> bool:
        return all(s.tokens() >= 3 for s in streams)

    await until(streaming, TIMEOUT_S, "every stream under way")
    gateway.signal(signal.SIGTERM)
    rc = await asyncio.to_thread(gateway.proc.wait, TIMEOUT_S)
    assert rc == 0
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
    reference = Reference()
    for s in streams:
        assert s.reconnects == 0, "the stream was cut instead of finished"
        ref = reference.text(s.body["prompt"], s.body["seed"], 40)
        assert not stream_faults(s, ref, 40)


async def test_sigterm_gateway_ends_streams_longer_than_its_grace_with_server_stopping(
    env: Env,
) -> None:
    """Every open stream (native, OpenAI chat, Responses) ends with its `server_stopping` end,
    and a request waiting for its whole answer gets a 503 saying so."""
    grace_s = 1.0
    gateway = env.cluster.gateway(GENQ_SHUTDOWN_GRACE_S=str(grace_s))
    env.worker("--step-ms", "50")
    messages = [{"role": "user", "content": "job 1"}]
    requests = {  # minutes of tokens each: past any grace
        "native": ("/v1/jobs", job_body(0, 3000, stream=True)),
        "chat": ("/v1/chat/completions", {"model": "sim", "messages": messages, "stream": True}),
        "responses": ("/v1/responses", {"model": "sim", "input": "job 2", "stream": True}),
        "waiting": ("/v1/chat/completions", {"model": "sim", "messages": messages}),
    }
    seen: dict[str, list[str]] = {name: [] for name in requests}
    ids: dict[str, str] = {}
    answered: dict[str, int] = {}

    async def send(name: str, route: str, body: dict) -> None:
        body.setdefault("max_tokens", 3000)
        if name == "responses":
            body["max_output_tokens"] = body.pop("max_tokens")
        async with env.http.stream("POST", f"{gateway.url}{route}", json=body) as r:
            ids[name], answered[name] = r.headers.get("x-job-id", ""), r.status_code
            async for line in r.aiter_lines():
                if line.startswith(("event:", "data:")) or name == "waiting":
                    seen[name].append(line)

    tasks = [asyncio.create_task(send(n, *request)) for n, request in requests.items()]

    async def under_way() -> bool:
        streams = [lines for name, lines in seen.items() if name != "waiting"]
        return all(len(lines) > 4 for lines in streams) and await _running(env) == len(requests)

    await until(under_way, TIMEOUT_S, "every request under way")
    gateway.signal(signal.SIGTERM)
    termed_at = time.monotonic()
    assert await asyncio.to_thread(gateway.proc.wait, grace_s + EXIT_SLACK_S) == 0
    assert time.monotonic() - termed_at < grace_s + EXIT_SLACK_S
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)  # each ended, none cut

    assert seen["native"][-2] == "event: error"
    end = json.loads(seen["native"][-1].removeprefix("data:"))
    assert end["code"] == "server_stopping" and end["resumes"] is True
    assert seen["chat"][-1] == "data: [DONE]"
    assert json.loads(seen["chat"][-2].removeprefix("data:"))["error"]["code"] == "server_stopping"
    assert seen["responses"][-2] == "event: error"
    assert json.loads(seen["responses"][-1].removeprefix("data:"))["code"] == "server_stopping"
    assert answered["waiting"] == 503
    assert json.loads("".join(seen["waiting"]))["error"]["code"] == "server_stopping"

    # as each end said: the native job goes on on its worker, the chat one is cancelled
    async def chat_cancelled() -> bool:
        return (await env.record(ids["chat"]))["status"] == "cancelled"

    await until(chat_cancelled, TIMEOUT_S, "the chat job cancelled")
    assert (await env.record(ids["native"]))["status"] == "running"


async def _running(env: Env) -> int:
    """How many jobs run now."""
    records = [key async for key in env.redis.scan_iter(match=KEYS.job("*"))]
    return sum([await env.redis.hget(key, "status") == "running" for key in records])
