"""genq on a Redis Cluster (3 primaries, 3 replicas, started once for this module): the main
flows through the gateway app and an in-process sim worker, with the queues in 3 shards, job
events on shard channels, and a submit's steps in the slots the plan puts them in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway import job_service
from gateway.app import _cluster_template
from gateway.deadline_sweep import ABANDON_S, RECONCILE_GRACE_S, DeadlineSweep
from gateway.pubsub_cluster import ClusterPubSub
from shared.errors import Unavailable
from shared.keys import PRIORITIES, Keys, scope_fields
from shared.records import QueueEntry
from shared.redisconn import connect
from shared.settings import Settings
from shared.transitions import Call, Queued, ScriptRunner
from tests.cluster import LocalCluster
from tests.conftest import REDIS_URL, Stack, gateway_only, gateways, parse_sse, running_stack
from tests.integration.test_placement import (
    FOLLOW_UP_SHARE,
    HISTORY,
    fake_worker,
    fleet,
    follow_ups,
)
from tests.integration.test_rate_limits import keys_file_flow, tokens_per_minute_flow
from tests.integration.test_token_fairness import SLOTS, A, B, backlog_shares
from tests.integration.test_webhooks import SECRET, hooked, job, receiver, until, unwrap
from tests.prefixes import test_prefix

SHARDS = 3
SLOW_STEP_MS = 20.0
QUOTA_JOB = {"model": "sim", "prompt": "x", "max_tokens": 8}
KILL_JOBS = 300
KILL_STREAMS = 100
KILL_WAIT_S = 60.0


def cluster_settings(cluster: LocalCluster, **overrides: Any) -> Settings:
    options: dict[str, Any] = dict(
        redis_cluster=cluster.seeds,
        queue_shards=SHARDS,
        key_prefix=test_prefix("cluster"),
        sim_step_ms=1.0,
        heartbeat_s=0.2,
        lease_s=1.0,
        claim_block_ms=200,
        shutdown_grace_s=2.0,
    )
    options.update(overrides)
    return Settings(**options)


@pytest.fixture
async def cstack(cluster: LocalCluster) -> AsyncIterator[Stack]:
    settings = cluster_settings(cluster)
    client = connect(settings)
    try:
        async with running_stack(settings, client) as s:
            yield s
    finally:
        await client.aclose()


@pytest.fixture(params=["redis", "cluster"])
async def either(request: pytest.FixtureRequest, cluster: LocalCluster) -> AsyncIterator[Stack]:
    """The same flow on one Redis (the shared one, today's layout) and on the cluster."""
    if request.param == "cluster":
        settings = cluster_settings(cluster)
    else:
        settings = Settings(
            redis_url=REDIS_URL,
            key_prefix=test_prefix(),
            sim_step_ms=1.0,
            heartbeat_s=0.2,
            lease_s=1.0,
            claim_block_ms=200,
            shutdown_grace_s=2.0,
        )
    client = connect(settings)
    try:
        async with running_stack(settings, client) as s:
            yield s
    finally:
        await client.aclose()


async def _stream(
    stack: Stack, job_id: str, timeout: float = 15.0, **request: Any
) -> list[tuple[int, str, dict]]:
    async with asyncio.timeout(timeout):
        r = await stack.client.get(f"/v1/jobs/{job_id}/events", **request)
    assert r.status_code == 200, r.text
    return parse_sse(r.text)


async def _follow(stack: Stack, job_id: str) -> list[tuple[int, str, dict]]:
    """A job's events as a client reads them through a failover: a 503 (the cluster not
    reachable yet) is asked again shortly, a stream cut short is resumed with Last-Event-ID,
    until the job's end."""
    events: list[tuple[int, str, dict]] = []
    async with asyncio.timeout(KILL_WAIT_S):
        while not events or events[-1][1] not in ("done", "error", "cancelled"):
            headers = {"Last-Event-ID": str(events[-1][0])} if events else {}
            r = await stack.client.get(f"/v1/jobs/{job_id}/events", headers=headers)
            if r.status_code == 503:
                await asyncio.sleep(0.2)
                continue
            assert r.status_code == 200, r.text
            events += parse_sse(r.text)
    return events


async def _ended(stack: Stack, job_id: str) -> dict[str, Any]:
    """The job once ended; a 503 while the cluster fails over is asked again."""
    async with asyncio.timeout(KILL_WAIT_S):
        while True:
            r = await stack.client.get(f"/v1/jobs/{job_id}")
            if r.status_code == 200 and r.json()["status"] not in ("queued", "running"):
                return dict(r.json())
            await asyncio.sleep(0.05)


async def admitted(client: Any, keys: Keys) -> dict[str, int]:
    """The admission counters, every stripe's added up."""
    total: dict[str, int] = {}
    for stripe in keys.stripes:
        for field, n in (await client.hgetall(keys.admission_counts(stripe))).items():
            total[field] = total.get(field, 0) + int(n)
    return total


async def released(client: Any, keys: Keys, within_s: float = 5.0) -> dict[str, int]:
    """The admission counters once every job's release has landed (within `within_s`): on a
    cluster a job's release is a step after its end, which a client may see first."""
    deadline = time.monotonic() + within_s
    while (counts := await admitted(client, keys)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return counts


def getkeys_calls(cluster: LocalCluster) -> int:
    """COMMAND GETKEYS calls so far, on every primary (INFO commandstats)."""
    total = 0
    for node in cluster.primaries():
        c = redis.Redis(port=node.port, decode_responses=True)
        try:
            stats = c.info("commandstats")
        finally:
            c.close()
        total += int(stats.get("cmdstat_command|getkeys", {}).get("calls", 0))
    return total


async def test_jobs_run_to_the_end_and_stream_on_a_cluster(
    cstack: Stack, cluster: LocalCluster
) -> None:
    keys = cstack.worker.st.keys
    getkeys = getkeys_calls(cluster)
    jobs: list[dict] = []
    # ids are random: submit until every shard has jobs (9 alone miss one shard 8 % of the
    # time; 40 miss one about once in three million)
    while len(jobs) < 40 and (
        len(jobs) < 9 or {keys.shard_of(j["id"]) for j in jobs} != set(range(SHARDS))
    ):
        jobs.append(await cstack.submit(prompt=f"job {len(jobs)}", max_tokens=8))
    assert {keys.shard_of(j["id"]) for j in jobs} == set(range(SHARDS))  # every shard used
    for submitted in jobs:
        done = await cstack.wait_status(submitted["id"], "succeeded")
        assert done["usage"]["completion_tokens"] == 8
        events = await _stream(cstack, submitted["id"])
        assert [e[0] for e in events] == list(range(1, len(events) + 1))
        assert events[0][1] == "queued" and events[-1][1] == "done"
    # every queue entry acknowledged and deleted; nothing pending in any shard
    for shard in range(SHARDS):
        assert await cstack.redis.hlen(keys.pending(shard)) == 0
        for p in PRIORITIES:
            assert await cstack.redis.xlen(keys.queue("sim", p, shard)) == 0
    # the claim reads' keys were found here, not asked of the server each time
    assert getkeys_calls(cluster) == getkeys


async def test_a_live_stream_gets_every_token_and_resumes_from_last_event_id(
    cluster: LocalCluster,
) -> None:
    settings = cluster_settings(cluster)
    client = connect(settings)
    try:
        async with running_stack(settings, client, step_ms=SLOW_STEP_MS) as stack:
            body = {"model": "sim", "prompt": "live", "max_tokens": 20, "stream": True}
            r = await stack.client.post("/v1/jobs", json=body)
            assert r.status_code == 200, r.text
            events = parse_sse(r.text)
            assert events[-1][1] == "done"
            text = "".join(e[2].get("text", "") for e in events if e[1] == "token")
            job_id = events[0][2]["id"]
            tail = await _stream(stack, job_id, headers={"Last-Event-ID": str(events[3][0])})
            assert tail == events[4:]
            view = (await stack.client.get(f"/v1/jobs/{job_id}")).json()
            assert view["text"] == text
    finally:
        await client.aclose()


async def test_openai_chat_completion_on_a_cluster(either: Stack) -> None:
    cstack = either
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    r = await cstack.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["completion_tokens"] == 6
    r = await cstack.client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [
        json.loads(line[6:])
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] is not None


async def test_cancel_of_a_running_job_on_a_cluster(cluster: LocalCluster) -> None:
    settings = cluster_settings(cluster)
    client = connect(settings)
    try:
        async with running_stack(settings, client, step_ms=SLOW_STEP_MS) as stack:
            job = await stack.submit(prompt="long", max_tokens=1000)
            await stack.wait_status(job["id"], "running")
            r = await stack.client.delete(f"/v1/jobs/{job['id']}")
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
            events = await _stream(stack, job["id"])
            assert events[-1][1] == "cancelled"
    finally:
        await client.aclose()


async def test_a_submit_stopped_between_its_steps_is_queued_once_by_the_reconciler(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record and first event written, the queue entry not (the gateway's process died, or
    lost Redis, between the two slots): the deadline sweep's reconciler queues the job, once,
    however often it runs, and a late queue step of the submit itself writes nothing more."""
    settings = cluster_settings(cluster)
    client = connect(settings)
    evalsha = ScriptRunner._evalsha
    stopped: list[Call[Any]] = []

    async def stop_before_the_queue_step(redis: Any, call: Call[Any]) -> Any:
        if call.script.name == "submit_queue" and not stopped:
            stopped.append(call)
            raise RedisConnectionError("injected: the submit stops here")
        return await evalsha(redis, call)

    try:
        async with running_stack(settings, client) as stack:
            monkeypatch.setattr(ScriptRunner, "_evalsha", staticmethod(stop_before_the_queue_step))
            r = await stack.client.post("/v1/jobs", json={"model": "sim", "prompt": "x"})
            assert r.status_code >= 500 and stopped
            monkeypatch.setattr(ScriptRunner, "_evalsha", staticmethod(evalsha))
            keys = stack.worker.st.keys
            (job_id,) = [
                j for s in range(SHARDS) for j in await client.zrange(keys.pending_since(s), 0, -1)
            ]
            record = await client.hget(keys.job(job_id), "status")
            assert record == "queued"  # recorded, not queued: no worker can see it
            sweep = DeadlineSweep(settings, client, ScriptRunner(client), keys)
            assert await sweep.reconcile() == []  # within the grace: left to its gateway
            later = time.time() + RECONCILE_GRACE_S + 1
            assert await sweep.reconcile(later) == [job_id]
            assert await sweep.reconcile(later) == []
            assert await ScriptRunner(client).run(stopped[0]) == Queued()  # the late step
            done = await stack.wait_status(job_id, "succeeded")
            assert done["attempt"] == 1
            events = await _stream(stack, job_id)
            assert [e[1] for e in events].count("started") == 1
            assert events[-1][1] == "done"
    finally:
        await client.aclose()


async def test_a_submit_stopped_before_its_record_is_given_up_and_its_key_freed(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after the idempotency claim and the pending entry, before the record: the
    reconciler gives the job up after its bound (a record written later still is refused),
    and the client's retry with the same key makes a new job that runs."""
    settings = cluster_settings(cluster)
    client = connect(settings)
    evalsha = ScriptRunner._evalsha
    stopped: list[Call[Any]] = []

    async def stop_before_the_record(redis: Any, call: Call[Any]) -> Any:
        if call.script.name == "submit_job" and not stopped:
            stopped.append(call)
            raise RedisConnectionError("injected: the submit stops here")
        return await evalsha(redis, call)

    try:
        async with running_stack(settings, client) as stack:
            monkeypatch.setattr(ScriptRunner, "_evalsha", staticmethod(stop_before_the_record))
            body = {"model": "sim", "prompt": "x", "max_tokens": 4}
            key = {"Idempotency-Key": "k1"}
            r = await stack.client.post("/v1/jobs", json=body, headers=key)
            assert r.status_code >= 500 and stopped
            monkeypatch.setattr(ScriptRunner, "_evalsha", staticmethod(evalsha))
            again = await stack.client.post("/v1/jobs", json=body, headers=key)
            assert again.status_code == 409  # the first is still being submitted, for all we know
            keys = stack.worker.st.keys
            sweep = DeadlineSweep(settings, client, ScriptRunner(client), keys)
            assert await sweep.reconcile(time.time() + ABANDON_S + 1) == []
            with pytest.raises(Unavailable):
                await ScriptRunner(client).run(stopped[0])  # the record, come too late
            retried = await stack.client.post("/v1/jobs", json=body, headers=key)
            assert retried.status_code == 202, retried.text
            assert (await stack.wait_status(retried.json()["id"], "succeeded"))["attempt"] == 1
            assert await released(client, keys) == {}
    finally:
        await client.aclose()


async def test_one_idempotency_key_sent_at_once_to_two_gateways_makes_one_job(
    cluster: LocalCluster,
) -> None:
    settings = cluster_settings(cluster)
    client = connect(settings)
    try:
        async with gateways(settings, client, 2) as clients:
            headers = {"Idempotency-Key": "together"}
            answers = await asyncio.gather(
                *(
                    clients[i % 2].post("/v1/jobs", json=QUOTA_JOB, headers=headers)
                    for i in range(6)
                )
            )
            made = {r.json()["id"] for r in answers if r.status_code in (200, 202)}
            assert len(made) == 1
            assert all(r.status_code in (200, 202, 409) for r in answers)
            assert [r.status_code for r in answers].count(202) == 1
            keys = settings.keys()
            jobs_field, _ = scope_fields("interactive", "sim")
            assert (await admitted(client, keys))[jobs_field] == 1
            pending = [await client.hlen(keys.pending(s)) for s in range(SHARDS)]
            assert pending == [0] * SHARDS
    finally:
        await client.aclose()


async def test_a_second_queue_entry_of_an_ended_job_runs_nothing(cstack: Stack) -> None:
    """A repeated queue entry is harmless: START of an ended job writes nothing, and the entry
    is acknowledged."""
    job = await cstack.submit(prompt="once", max_tokens=4)
    await cstack.wait_status(job["id"], "succeeded")
    keys = cstack.worker.st.keys
    before = await _stream(cstack, job["id"])
    queue = keys.queue("sim", "interactive", keys.shard_of(job["id"]))
    await cstack.redis.xadd(queue, QueueEntry(job=job["id"], tokens=8).to_hash())
    async with asyncio.timeout(10):
        while await cstack.redis.xlen(queue):
            await asyncio.sleep(0.02)
    assert await _stream(cstack, job["id"]) == before
    assert (await cstack.client.get(f"/v1/jobs/{job['id']}")).json()["attempt"] == 1


async def test_a_batch_completes_on_a_cluster(either: Stack) -> None:
    cstack = either
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "sim",
                "messages": [{"role": "user", "content": f"q{i}"}],
                "max_tokens": 4,
            },
        }
        for i in range(12)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    files = {"file": ("in.jsonl", content, "application/jsonl")}
    r = await cstack.client.post("/v1/files", files=files, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    body = {
        "input_file_id": r.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    r = await cstack.client.post("/v1/batches", json=body)
    assert r.status_code == 200, r.text
    batch_id = r.json()["id"]
    async with asyncio.timeout(30):
        while (batch := (await cstack.client.get(f"/v1/batches/{batch_id}")).json())[
            "status"
        ] not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.05)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    out = await cstack.client.get(f"/v1/files/{batch['output_file_id']}/content")
    ids = sorted(json.loads(line)["custom_id"] for line in out.text.splitlines())
    assert ids == sorted(f"line-{i}" for i in range(12))


async def test_the_gateways_pubsub_holds_one_connection_per_node_and_hears_spublish(
    cluster: LocalCluster,
) -> None:
    settings = cluster_settings(cluster)
    client = connect(settings)
    backend = ClusterPubSub(client, _cluster_template(settings), "genq-test-pubsub")
    heard: list[tuple[str, str]] = []
    confirmed: list[str] = []
    task = asyncio.create_task(
        backend.run(lambda c, d: heard.append((c, d)), lambda: None, confirmed.append)
    )
    try:
        keys = settings.keys()
        channels = [keys.channel(f"job-{i}") for i in range(30)]
        await backend.subscribe(*channels)
        async with asyncio.timeout(10):
            while len(confirmed) < len(channels):
                await asyncio.sleep(0.02)
        assert len(backend.nodes) == len(cluster.primaries())
        assert sorted(c for chans in backend.nodes.values() for c in chans) == sorted(channels)
        for c in channels:
            assert (
                await client.execute_command("SPUBLISH", c, "hello") == 1
            )  # heard on the slot's node only
        async with asyncio.timeout(10):
            while len(heard) < len(channels):
                await asyncio.sleep(0.02)
        assert sorted(heard) == sorted((c, "hello") for c in channels)
        await backend.unsubscribe(*channels[:10])
        async with asyncio.timeout(10):
            while [c for c in channels[:10] if await client.execute_command("SPUBLISH", c, "late")]:
                await asyncio.sleep(0.02)
    finally:
        await backend.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()


async def test_quotas_hold_across_gateways_and_release_at_the_end_on_a_cluster(
    cluster: LocalCluster,
) -> None:
    """The admission step counts atomically in its slot whatever shard a job goes to: two
    gateways cannot overshoot a limit; an idempotent retry is not counted twice; cancelled
    and finished jobs stop counting."""
    limit, tries = 6, 16
    settings = cluster_settings(cluster, max_queued_jobs={"interactive": limit})
    client = connect(settings)
    keys = settings.keys()
    try:
        async with gateways(settings, client, 2) as clients:
            answers = await asyncio.gather(
                *(clients[i % 2].post("/v1/jobs", json=QUOTA_JOB) for i in range(tries))
            )
            codes = sorted(r.status_code for r in answers)
            assert codes == [202] * limit + [429] * (tries - limit)
            lanes = keys.all_lanes("sim", "interactive")
            assert sum([await client.xlen(q) for q in lanes]) == limit
            for r in answers:
                if r.status_code == 202:
                    assert (
                        await clients[0].delete(f"/v1/jobs/{r.json()['id']}")
                    ).status_code == 200
            assert await admitted(client, keys) == {}
            again = {"Idempotency-Key": "same"}
            first = await clients[0].post("/v1/jobs", json=QUOTA_JOB, headers=again)
            second = await clients[1].post("/v1/jobs", json=QUOTA_JOB, headers=again)
            assert (first.status_code, second.status_code) == (202, 200)  # 200: the replay
            assert first.json()["id"] == second.json()["id"]
            jobs_field, _ = scope_fields("interactive", "sim")
            assert (await admitted(client, keys))[jobs_field] == 1
    finally:
        await client.aclose()


async def test_a_limit_is_held_exactly_when_every_job_lands_in_one_stripe(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admission counters are striped over the queue shards' slots (not one slot taking
    every job's admission): each stripe admits its share of a limit (4 over 3: 2, 1, 1), a
    job its own stripe refuses is counted in the next with room, so the fleet admits the
    limit exactly, and a job's end releases it in the stripe that counted it."""
    limit = 4
    settings = cluster_settings(cluster, max_queued_jobs={"interactive": limit})
    keys = settings.keys()
    own_zero = (u for u in iter(uuid.uuid4, None) if keys.shard_of(u.hex) == 0)
    monkeypatch.setattr(job_service.uuid, "uuid4", lambda: next(own_zero))
    client = connect(settings)
    jobs_field, _ = scope_fields("interactive", "sim")
    try:
        async with gateways(settings, client, 1) as [api]:
            made = [await api.post("/v1/jobs", json=QUOTA_JOB) for _ in range(limit + 1)]
            assert [r.status_code for r in made] == [202] * limit + [429]
            assert "4 interactive jobs queued or running" in made[-1].json()["error"]["message"]
            per_stripe = [
                await client.hget(keys.admission_counts(i), jobs_field) for i in keys.stripes
            ]
            assert per_stripe == ["2", "1", "1"]
            slots = {key_slot(keys.admission_counts(i).encode()) for i in keys.stripes}
            assert len(slots) == SHARDS
            spilled = made[limit - 1].json()["id"]  # counted in stripe 2
            assert (await api.delete(f"/v1/jobs/{spilled}")).status_code == 200
            assert await client.hget(keys.admission_counts(2), jobs_field) is None
            assert (await api.post("/v1/jobs", json=QUOTA_JOB)).status_code == 202
            assert (await admitted(client, keys))[jobs_field] == limit
    finally:
        await client.aclose()


async def test_tokens_per_minute_and_request_rates_hold_on_a_cluster(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The single-Redis flows of tests/integration/test_rate_limits.py, on the cluster: the
    owner's buckets share its slot, and the charge is a step of the submit."""
    settings = cluster_settings(cluster)
    client = connect(settings)
    try:
        limited = cluster_settings(
            cluster, api_keys=["key-a", "key-b"], tokens_per_minute_per_key=100
        )
        await tokens_per_minute_flow(limited, client)
        await keys_file_flow(settings, client, tmp_path)
    finally:
        await client.aclose()


async def test_a_job_a_limit_refuses_after_its_charge_gets_its_tokens_back(
    cluster: LocalCluster,
) -> None:
    """On a cluster the tokens are taken in a step before the admission: a job the jobs
    limit then refuses (every stripe full) has its charge given back, as one Redis, which
    checks both in one step, never takes it."""
    settings = cluster_settings(
        cluster,
        api_keys=["key-a"],
        tokens_per_minute_per_key=100,
        max_queued_jobs={"interactive": 1},
    )
    client = connect(settings)
    headers = {"Authorization": "Bearer key-a"}
    job = {"model": "sim", "prompt": "x", "max_tokens": 40}  # 41 tokens
    try:
        async with gateways(settings, client, 1) as [api]:
            first = await api.post("/v1/jobs", json=job, headers=headers)
            assert first.headers["x-ratelimit-remaining-tokens"] in ("59", "60")
            full = await api.post("/v1/jobs", json=job, headers=headers)
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
            gone = await api.delete(f"/v1/jobs/{first.json()['id']}", headers=headers)
            assert gone.status_code == 200
            again = await api.post("/v1/jobs", json=job, headers=headers)
            assert again.status_code == 202, again.text  # 59 + what refilled, less 41
            assert int(again.headers["x-ratelimit-remaining-tokens"]) in range(18, 22)
    finally:
        await client.aclose()


async def _batch_of(stack: Stack, n: int) -> str:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "sim", "prompt": f"q{i}", "max_tokens": 2},
        }
        for i in range(n)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    files = {"file": ("in.jsonl", content, "application/jsonl")}
    r = await stack.client.post("/v1/files", files=files, data={"purpose": "batch"})
    body = {"input_file_id": r.json()["id"], "endpoint": "/v1/completions"}
    r = await stack.client.post("/v1/batches", json={**body, "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


async def test_webhooks_are_delivered_on_a_cluster_whatever_step_an_end_stopped_at(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signed as on one Redis, retried through a receiver's 503s (the sender's MULTI on the
    `{webhooks}` slot). A job's end whose outbox step was lost (the worker's write stops
    after the end) is told by the START that reclaims its entry; a batch's final status
    whose outbox step was lost, by the driver cleaning the batch up."""
    evalsha, pipeline = ScriptRunner._evalsha, ScriptRunner._pipeline
    lost: list[str] = []

    def lose(call: Call[Any]) -> bool:
        name = call.script.name
        if name in ("tell_stream", "tell_batch") and name not in lost:
            lost.append(name)
            return True
        return False

    async def lose_the_first_tell(redis: Any, call: Call[Any]) -> Any:
        if lose(call):
            raise RedisConnectionError("injected: the end stops before the outbox heard")
        return await evalsha(redis, call)

    async def lose_it_in_a_pipeline(runner: ScriptRunner, calls: list[Call[Any]]) -> list[Any]:
        dropped = [lose(c) for c in calls]
        kept = [c for c, d in zip(calls, dropped, strict=True) if not d]
        sent = iter(await pipeline(runner, kept))
        return [RedisConnectionError("injected") if d else next(sent) for d in dropped]

    with receiver() as rx:
        rx.answers = [503, 503]
        endpoints = [{"url": rx.url, "secret": SECRET, "events": ["batch.completed"]}]
        settings = hooked(cluster_settings(cluster), webhooks=endpoints)
        client = connect(settings)
        try:
            async with running_stack(settings, client) as stack:
                monkeypatch.setattr(ScriptRunner, "_evalsha", staticmethod(lose_the_first_tell))
                monkeypatch.setattr(ScriptRunner, "_pipeline", lose_it_in_a_pipeline)
                jobs = [await job(stack, max_tokens=2, webhook={"url": rx.url}) for _ in range(3)]
                batch = await _batch_of(stack, 3)
                await until(lambda: len({e["data"]["id"] for e in rx.events()}) == 4, 30)
                assert lost == ["tell_stream", "tell_batch"]
                await asyncio.sleep(0.3)  # nothing more comes
        finally:
            await client.aclose()
    delivered = [unwrap(seen, SECRET) for seen in rx.seen]  # each signed right
    kinds = {e.data.id: e.type for e in delivered}
    assert kinds == {**{j: "job.succeeded" for j in jobs}, batch: "batch.completed"}
    by_id: dict[str, set[str]] = {}
    for headers, body in rx.seen:
        by_id.setdefault(json.loads(body)["data"]["id"], set()).add(headers["webhook-id"])
    assert all(len(ids) == 1 for ids in by_id.values())  # retries under the event's one id
    assert len(rx.delivered) == 4


async def test_token_fair_weights_hold_on_a_cluster(cluster: LocalCluster) -> None:
    """Token-fair scheduling there: each queue shard's jobs wait in its own fair queue, with
    its own virtual clock; the owners' jobs spread over the shards, so a 3:1 weight gives
    about three quarters of the tokens, as on one Redis."""
    settings = cluster_settings(
        cluster,
        api_keys=[A, B],
        max_batch=SLOTS,
        key_weights={A: 1.0, B: 3.0},
        fair_scheduling="tokens",
    )
    client = connect(settings)
    try:
        async with running_stack(settings, client, step_ms=10) as stack:
            shares = await backlog_shares(stack, {A: "the model", B: "the model"}, window=40)
    finally:
        await client.aclose()
    assert 0.65 <= shares[B] <= 0.85, shares


async def test_placement_on_a_cluster_sends_each_follow_up_where_its_prompt_is(
    cluster: LocalCluster,
) -> None:
    """Cache-aware placement there: the worker's lane is in the job's queue shard, the
    cache news go out on a shard channel (a worker's counting its lanes in every shard), and
    the steal sweep walks each shard's lanes. The 0-second follow-up of test_placement.py
    finds its prompt cached as on one Redis."""
    settings = cluster_settings(
        cluster,
        heartbeat_s=1.0,
        lease_s=5.0,
        placement_refresh_s=0.5,
        placement_sweep_s=0.1,
    )
    client = connect(settings)
    keys = settings.keys()
    try:
        async with fleet(settings, client, 2, cache_tokens=16 * 4800, prefill_ms_per_1k=5) as (
            api,
            ws,
        ):
            turns = await follow_ups(api)
            lanes = [await client.smembers(keys.placed_lanes(i)) for i in keys.stripes]
            metrics = (await api.get("/metrics")).text
    finally:
        await client.aclose()
    share = sum(c for c, _ in turns) / sum(p for _, p in turns)
    placements = [line for line in metrics.splitlines() if "genq_placements_total{" in line]
    assert share >= FOLLOW_UP_SHARE, (turns, placements)
    ids = {w.st.id for w in ws}
    placed = [lane for shard in lanes for lane in shard]
    assert placed and all(lane.rpartition(":w:")[2] in ids for lane in placed)
    assert 'genq_placements_total{outcome="prefix"}' in metrics


async def test_a_dead_workers_lanes_are_emptied_in_every_shard(cluster: LocalCluster) -> None:
    """Jobs placed on a worker that dies wait in its lanes of several queue shards: the
    steal sweep moves each shard's to that shard's queue at once, and they run."""
    settings = cluster_settings(
        cluster, placement_refresh_s=0.05, placement_sweep_s=0.05, placement_wait_s=60
    )
    client = connect(settings)
    keys = settings.keys()
    try:
        async with fleet(settings, client, workers=1) as (api, ws):
            fake = await fake_worker(client, settings, ws[0], HISTORY)
            made: list[str] = []
            while len(made) < 12 and len({keys.shard_of(j) for j in made}) < 2:
                body = {"model": "sim", "prompt": f"{HISTORY} {len(made)}", "max_tokens": 4}
                made.append((await api.post("/v1/jobs", json=body)).json()["id"])
            lanes = {keys.placed("sim", "interactive", fake, keys.shard_of(j)) for j in made}
            assert len(lanes) >= 2 and all([await client.xlen(lane) for lane in lanes])
            await client.delete(keys.worker(fake))  # it dies: its heartbeat lapses
            async with asyncio.timeout(10):  # far below the 60 s deadline
                for job_id in made:
                    while (await api.get(f"/v1/jobs/{job_id}")).json()["status"] != "succeeded":
                        await asyncio.sleep(0.02)
            assert not any([await client.exists(lane) for lane in lanes])
    finally:
        await client.aclose()


async def test_a_queued_job_past_its_deadline_expires_on_a_cluster(cluster: LocalCluster) -> None:
    """No worker for its model: the gateway's sweep of the shard's deadlines index ends it."""
    settings = cluster_settings(cluster, deadline_sweep_s=0.1)
    client = connect(settings)
    try:
        async with gateway_only(settings, client) as http:
            body = {"model": "sim", "prompt": "nobody runs me", "timeout_s": 1}
            r = await http.post("/v1/jobs", json=body)
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            async with asyncio.timeout(10):
                while (view := (await http.get(f"/v1/jobs/{job_id}")).json())["status"] == "queued":
                    await asyncio.sleep(0.05)
            assert view["status"] == "expired"
            keys = settings.keys()
            index = keys.deadlines(keys.shard_of(job_id))
            async with asyncio.timeout(5):  # the index follows the end, a step after it
                while await client.zscore(index, job_id) is not None:
                    await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def test_slots_migrated_while_jobs_run_lose_and_repeat_nothing(
    cluster: LocalCluster,
) -> None:
    """A queue shard's slot and running jobs' slots migrated to another primary (a reshard)
    while jobs are queued, running and streamed: every job ends once, every stream whole."""
    settings = cluster_settings(cluster)
    client = connect(settings)
    try:
        async with running_stack(settings, client, step_ms=10.0) as stack:
            keys = stack.worker.st.keys
            jobs = [await stack.submit(prompt=f"m{i}", max_tokens=40) for i in range(30)]
            streams = [
                asyncio.create_task(_stream(stack, j["id"], timeout=KILL_WAIT_S)) for j in jobs[:8]
            ]
            await asyncio.sleep(0.2)
            slots = {slot_of(keys.queue("sim", "interactive", 0))}
            slots |= {slot_of(keys.job(j["id"])) for j in jobs[:8]}
            moved = 0
            for slot in sorted(slots):
                here = cluster.node_of(slot)
                there = next(n for n in cluster.primaries() if n.port != here.port)
                moved += await asyncio.to_thread(cluster.move_slot, slot, there)
            assert moved >= 8 * 2  # at least each streamed job's record and log moved
            views = [await _ended(stack, j["id"]) for j in jobs]
            assert [v["status"] for v in views] == ["succeeded"] * len(jobs)
            for task, view in zip(streams, views, strict=False):
                events = await task
                assert [e[0] for e in events] == list(range(1, len(events) + 1))
                assert [e[1] for e in events].count("done") == 1
                text = "".join(e[2].get("text", "") for e in events if e[1] == "token")
                assert text == view["text"]
    finally:
        await client.aclose()


def slot_of(key: str) -> int:
    return int(key_slot(key.encode()))


async def test_a_primary_killed_under_load_loses_and_repeats_nothing(
    cluster: LocalCluster,
) -> None:
    """SIGKILL of a primary while jobs are queued, running and streamed (300 jobs, 100 of
    them streamed): its replica is promoted, clients follow the slot map, and every job ends
    once, its stream whole as a client reads it (no event missing or repeated, the text the
    record holds; a client asks again after a 503 and resumes with Last-Event-ID). Last in
    this module: the killed node is started again after, and rejoins as a replica."""
    settings = cluster_settings(cluster, lease_s=5.0, heartbeat_s=0.5)
    client = connect(settings)
    victim = cluster.primaries()[0]
    try:
        async with running_stack(settings, client, step_ms=10.0) as stack:
            jobs = [await stack.submit(prompt=f"j{i}", max_tokens=30) for i in range(KILL_JOBS)]
            streams = [asyncio.create_task(_follow(stack, j["id"])) for j in jobs[:KILL_STREAMS]]
            await asyncio.sleep(0.3)
            victim.kill()
            views = [await _ended(stack, j["id"]) for j in jobs]
            unhappy = [v for v in views if v["status"] != "succeeded"]
            assert not unhappy, unhappy
            assert all(v["usage"]["completion_tokens"] == 30 for v in views)
            for task, view in zip(streams, views, strict=False):
                events = await task
                assert [e[0] for e in events] == list(range(1, len(events) + 1))
                assert [e[1] for e in events].count("done") == 1
                text = "".join(e[2].get("text", "") for e in events if e[1] == "token")
                assert text == view["text"]
    finally:
        await client.aclose()
        victim.start()
        cluster.wait_ready()
