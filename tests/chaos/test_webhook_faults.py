"""Webhooks under faults: 40 jobs with a webhook, the receiver down (503) throughout; a worker
SIGKILLed mid-job (its jobs continue elsewhere) and redis-server SIGKILLed and started again
(AOF); then the receiver comes up. Every job ends, every end's event arrives — one event id
per job, whatever the repeats — and none for anything else."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from tests.chaos.harness import FAST_LEASES, until
from tests.chaos.scenarios import KEYS, chaos_env, job_body, statuses
from tests.integration.test_webhooks import SECRET, receiver

JOBS = 40
TOKENS = 40
TIMEOUT_S = 90.0


async def test_every_end_is_told_through_a_worker_kill_a_redis_restart_and_a_receiver_down(
    tmp_path: Path,
) -> None:
    hooks = {
        "GENQ_WEBHOOK_SECRET": SECRET,
        "GENQ_WEBHOOK_ALLOW_HTTP": "true",
        "GENQ_WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]',
        "GENQ_WEBHOOK_POLL_S": "0.05",
        "GENQ_WEBHOOK_BACKOFF_S": "0.1",
        "GENQ_WEBHOOK_BACKOFF_MAX_S": "0.5",
        "GENQ_WEBHOOK_LEASE_S": "2",
        # an attempt in flight when Redis went is tried again a few timeouts on
        "GENQ_WEBHOOK_TIMEOUT_S": "1",
    }
    with receiver() as rx:
        rx.mode = "down"
        async with chaos_env(tmp_path, **hooks) as env:
            gateway = env.cluster.gateway()
            victim = env.worker("--step-ms", "30", "--max-batch", "16")
            env.worker("--step-ms", "30", "--max-batch", "16")
            await env.wait_workers(2)
            ids = []
            for i in range(JOBS):
                body = {**job_body(i, TOKENS), "webhook": {"url": rx.url}}
                r = await env.http.post(f"{gateway.url}/v1/jobs", json=body)
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])

            async def some_running() -> bool:
                return (await statuses(env, ids))["running"] >= 8

            await until(some_running, TIMEOUT_S, "jobs running")
            os.kill(victim.proc.pid, signal.SIGKILL)  # mid-job
            await asyncio.sleep(1.0)
            env.redis_server.kill()
            await asyncio.sleep(float(FAST_LEASES["GENQ_LEASE_S"]))
            env.redis_server.start()

            async def all_ended() -> bool:
                return (await statuses(env, ids))["succeeded"] == JOBS

            await until(all_ended, TIMEOUT_S, f"all {JOBS} jobs to succeed", poll=0.25)
            assert rx.seen, "the receiver was tried while down"
            rx.mode = "ok"

            async def all_told() -> bool:  # answered 2xx, not only tried
                return {json.loads(b)["data"]["id"] for b in rx.delivered} >= set(ids)

            await until(all_told, TIMEOUT_S, "every event delivered", poll=0.25)
            await asyncio.sleep(1.0)  # what was due is sent: nothing more comes
            assert await env.redis.zcard(KEYS.webhook_due()) == 0
    told: dict[str, set[str]] = {}
    for headers, body in rx.seen:
        event = json.loads(body)
        assert event["type"] == "job.succeeded"
        told.setdefault(event["data"]["id"], set()).add(headers["webhook-id"])
    assert set(told) == set(ids)  # every end, and nothing else
    assert all(len(v) == 1 for v in told.values())  # repeats under one id
