"""Deadlines without workers, cancels without the control channel, stalled and crashed
workers' leftovers, and malformed queue entries (issue 12 items 4, 5, 7, 8; issue 13 item 1),
with real genq and redis-server processes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from shared.records import ANONYMOUS, JobRecord, QueueEntry
from shared.schemas import JobSpec, Sampling
from tests.chaos.harness import Stream, follow, until
from tests.chaos.scenarios import KEYS, Env, job_body, worker_pid
from tests.procs import StallProxy

TIMEOUT_S = 30.0
SWEEP_SLACK_S = 2.5
"""A deadline holds within the gateway's sweep interval (1 s), a lease (1 s) and a poll."""
STALE_BEATS_S = 1.0
"""A few of a worker's heartbeats (0.2 s apart in these tests)."""
CANCEL_WITHOUT_CONTROL_S = 0.4
"""A cancel noticed by the worker's next write, not its control channel's reconnect (≥ 0.5 s)."""


async def _status(env: Env, job_id: str) -> str | None:
    return await env.redis.hget(KEYS.job(job_id), "status")  # type: ignore[no-any-return]


async def _wait_status(env: Env, job_id: str, *wanted: str, limit: float = TIMEOUT_S) -> float:
    """Seconds until the job reaches one of `wanted`."""
    t0 = time.monotonic()

    async def there() -> bool:
        return await _status(env, job_id) in wanted

    await until(there, limit, f"job {job_id} {wanted}")
    return time.monotonic() - t0


async def _submit(http: httpx.AsyncClient, url: str, **body: object) -> str:
    r = await http.post(f"{url}/v1/jobs", json={"model": "sim", "prompt": "the model", **body})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def test_a_deadline_holds_with_no_worker_up(env: Env) -> None:
    gateway = env.cluster.gateway()
    worker = env.worker("--step-ms", "5")
    await env.wait_workers(1)
    assert worker.stop() == 0  # drained and gone: nobody will start anything
    submitted = time.monotonic()
    job = await _submit(env.http, gateway.url, max_tokens=10, timeout_s=2)
    await _wait_status(env, job, "expired")
    assert time.monotonic() - submitted <= 2 + SWEEP_SLACK_S
    events = await env.log(job)
    assert events[-1]["type"] == "error" and events[-1]["code"] == "deadline_exceeded"
    assert await env.redis.zscore(KEYS.deadlines(), job) is None  # it left the index


async def test_a_running_job_whose_worker_died_expires_at_its_deadline(env: Env) -> None:
    gateway = env.cluster.gateway()
    worker = env.worker("--step-ms", "50")
    await env.wait_workers(1)
    submitted = time.monotonic()
    job = await _submit(env.http, gateway.url, max_tokens=5000, timeout_s=3)
    await _wait_status(env, job, "running")
    worker.kill()
    await _wait_status(env, job, "expired")
    assert time.monotonic() - submitted <= 3 + SWEEP_SLACK_S


async def test_a_job_past_its_deadline_reads_expired_at_once(env: Env) -> None:
    gateway = env.cluster.gateway(GENQ_DEADLINE_SWEEP_S="60")  # only the read can end it
    worker = env.worker("--step-ms", "5")
    await env.wait_workers(1)
    assert worker.stop() == 0
    job = await _submit(env.http, gateway.url, max_tokens=10, timeout_s=1)
    await asyncio.sleep(1.05)  # past the deadline, long before any sweep
    view = (await env.http.get(f"{gateway.url}/v1/jobs/{job}")).json()
    assert view["status"] == "expired" and view["error"]["code"] == "deadline_exceeded"
    assert await _status(env, job) == "expired"


async def test_a_finished_job_leaves_the_deadlines_index(env: Env) -> None:
    gateway = env.cluster.gateway()
    env.worker("--step-ms", "1")
    await env.wait_workers(1)
    job = await _submit(env.http, gateway.url, max_tokens=5, timeout_s=3600)
    await _wait_status(env, job, "succeeded")
    assert await env.redis.zscore(KEYS.deadlines(), job) is None


async def test_a_cancel_right_after_the_control_channel_dropped_frees_the_slot(env: Env) -> None:
    gateway = env.cluster.gateway()
    env.worker("--step-ms", "20")
    await env.wait_workers(1)
    for _ in range(3):
        job = await _submit(env.http, gateway.url, max_tokens=5000)
        await _wait_status(env, job, "running")
        await env.redis.client_kill_filter(_type="pubsub")  # the worker's control channel too
        t0 = time.monotonic()
        r = await env.http.delete(f"{gateway.url}/v1/jobs/{job}")
        assert r.status_code == 200, r.text
        await _wait_status(env, job, "cancelled", limit=5)
        assert time.monotonic() - t0 < CANCEL_WITHOUT_CONTROL_S


async def test_a_worker_back_from_a_network_stall_takes_no_entry_that_moved(env: Env) -> None:
    """Its heartbeat sent before the stall arrives after it: it must not take back the entries
    another worker reclaimed meanwhile (issue 12, item 7)."""
    env.cluster.gateway()
    proxy = StallProxy(env.redis_server.port)
    await proxy.start()
    try:
        stale = env.worker("--step-ms", "50", "--max-batch", "32", GENQ_REDIS_URL=proxy.url)
        await env.wait_workers(1)
        streams = [Stream(job_body(i, 200)) for i in range(20)]
        tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

        async def streaming() -> bool:
            return all(s.tokens() >= 2 for s in streams)

        await until(streaming, TIMEOUT_S, "every stream under way")
        ids = [s.job_id or "" for s in streams]
        stale_id = await env.owner(ids[0])
        assert stale_id is not None and worker_pid(stale_id) == stale.proc.pid
        proxy.stall()
        fresh = env.worker("--step-ms", "50", "--max-batch", "32", wait_model=None)

        async def moved() -> bool:
            owners = [await env.owner(j) for j in ids]
            return all(worker_pid(o or "0-0-0") == fresh.proc.pid for o in owners)

        await until(moved, TIMEOUT_S, "the stalled worker's jobs to move")
        proxy.resume()
        queue = KEYS.queue("sim", "interactive")
        taken = 0
        watch_until = time.monotonic() + STALE_BEATS_S  # what the stale worker sent arrives
        while time.monotonic() < watch_until:  # the other worker's beats take them back soon
            pending = await env.redis.xpending_range(queue, "workers", "-", "+", 1000)
            taken = max(taken, sum(p["consumer"] == stale_id for p in pending))
            await asyncio.sleep(0.01)
        assert taken == 0, f"{taken} entries taken back by the stale worker"
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
    finally:
        await proxy.close()


async def test_a_crashed_workers_consumer_and_membership_are_removed(env: Env) -> None:
    gateway = env.cluster.gateway()
    victim = env.worker("--step-ms", "20")
    env.worker("--step-ms", "20", wait_model=None)
    await env.wait_workers(2)
    jobs = [await _submit(env.http, gateway.url, max_tokens=200, seed=i) for i in range(6)]
    for j in jobs:
        await _wait_status(env, j, "running")
    victim_ids = {o for j in jobs if (o := await env.owner(j)) and worker_pid(o) == victim.proc.pid}
    assert victim_ids, "the victim runs some of the jobs"
    victim.kill()
    for j in jobs:
        await _wait_status(env, j, "succeeded")

    async def forgotten() -> bool:
        consumers = await env.redis.xinfo_consumers(KEYS.queue("sim", "interactive"), "workers")
        members = set(await env.redis.zrange(KEYS.workers(), 0, -1))
        return not victim_ids & ({c["name"] for c in consumers} | members)

    await until(forgotten, TIMEOUT_S, "the dead worker's consumer and member to go")


async def test_malformed_queue_entries_cost_only_themselves(env: Env) -> None:
    """Entries naming no job (no field, not an id, not UTF-8: a pickle), and a forged record
    whose spec is another job's: dead-lettered with the reason; valid jobs in the same read
    run; and crash recovery still works afterwards."""
    gateway = env.cluster.gateway()
    first = env.worker("--step-ms", "20", "--max-batch", "8")
    await env.wait_workers(1)
    queue = KEYS.queue("sim", "interactive")
    raw = env.redis  # decode_responses: bytes are written as they are given
    await raw.xadd(queue, {"tokens": "3"})
    await raw.xadd(queue, {"job": "not a job id", "tokens": "3"})
    await raw.xadd(
        queue, {"job": b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00}\x94.", "tokens": 1}
    )
    forged = "f" * 32
    spec = JobSpec(
        id="e" * 32,
        model="sim",
        input_ids=[1, 2],
        max_tokens=3,
        sampling=Sampling(),
        priority="interactive",
        created_at=time.time(),
    )
    await raw.hset(
        KEYS.job(forged), mapping=JobRecord(spec=spec, status="queued", owner=ANONYMOUS).to_hash()
    )
    await raw.xadd(queue, QueueEntry(job=forged, tokens=5).to_hash())
    valid = [await _submit(env.http, gateway.url, max_tokens=20, seed=i) for i in range(3)]
    for j in valid:
        await _wait_status(env, j, "succeeded")
    await _wait_status(env, forged, "failed")

    async def lettered() -> bool:
        return len(await env.redis.xrange(KEYS.dead_letters())) >= 4

    await until(lettered, TIMEOUT_S, "the dead letters")
    letters = [f for _, f in await env.redis.xrange(KEYS.dead_letters())]
    reasons = [f["reason"] for f in letters]
    assert sum("job" in r for r in reasons) >= 3, reasons
    assert any(f.get("job") == forged for f in letters)
    # Recovery still works: a worker killed now has its job reclaimed by the next one.
    job = await _submit(env.http, gateway.url, max_tokens=300, seed=99)
    await _wait_status(env, job, "running")
    first.kill()
    env.worker("--step-ms", "5", "--max-batch", "8", wait_model=None)
    await _wait_status(env, job, "succeeded", limit=15)
    assert json.loads(await env.redis.hget(KEYS.job(job), "result") or "{}")["text"]
