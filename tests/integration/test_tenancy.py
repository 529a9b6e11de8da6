"""Tenant isolation (issue 13, item 5): a job belongs to the API key that submitted it. Another
key gets 404 on every route of it (as for a job that does not exist); idempotency keys are
per owner; admin keys see and cancel everything; the record holds a hash of the key, never
the key; and jobs written before owners were recorded still run."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from shared import events
from shared.keys import Keys
from shared.quotas import Admission
from shared.records import OWNERS_SINCE, JobRecord, QueueEntry
from shared.schemas import JobSpec, Sampling
from shared.settings import GatewaySettings, Settings
from shared.transitions import ScriptRunner, Transitions
from tests.conftest import Stack, gateway_only, running_stack

A, B, ADMIN = "key-a-0123", "key-b-4567", "key-admin-89"
LONG = 8_000
"""Tokens: a job that runs for seconds, until cancelled."""
WAIT_S = 10.0
POLL_S = 0.02


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _keyed(settings: Settings, **more: object) -> Settings:
    return Settings(**{**settings.model_dump(), "api_keys": [A, B], "admin_keys": [ADMIN], **more})


async def _wait(stack: Stack, job_id: str, key: str, status: str) -> dict:
    async with asyncio.timeout(WAIT_S):
        while True:
            job = (await stack.client.get(f"/v1/jobs/{job_id}", headers=_h(key))).json()
            if job["status"] == status:
                return job
            await asyncio.sleep(POLL_S)


async def test_another_key_gets_404_on_every_route_of_a_job(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(_keyed(settings), redis) as stack:
        c = stack.client
        body = {"model": "sim", "prompt": "mine", "max_tokens": 50}
        job = (await c.post("/v1/jobs", json=body, headers=_h(A))).json()
        path = f"/v1/jobs/{job['id']}"
        unknown = f"/v1/jobs/{'f' * 32}"
        for method, suffix in (("GET", ""), ("GET", "/events"), ("DELETE", "")):
            theirs = await c.request(method, path + suffix, headers=_h(B))
            nobodys = await c.request(method, unknown + suffix, headers=_h(B))
            assert theirs.status_code == 404, (method, suffix, theirs.text)
            # the same answer as for a job that does not exist: nothing says it does
            assert theirs.json()["error"]["code"] == nobodys.json()["error"]["code"]
        done = await _wait(stack, job["id"], A, "succeeded")  # B's DELETE changed nothing
        assert (await c.get(path, headers=_h(A))).json()["text"] == done["text"]
        assert (await c.get(path + "/events", headers=_h(A))).status_code == 200


async def test_admin_keys_see_and_cancel_every_job(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(_keyed(settings), redis) as stack:
        c = stack.client
        body = {"model": "sim", "prompt": "long", "max_tokens": LONG}
        job = (await c.post("/v1/jobs", json=body, headers=_h(A))).json()
        path = f"/v1/jobs/{job['id']}"
        assert (await c.get(path, headers=_h(ADMIN))).status_code == 200
        cancelled = await c.delete(path, headers=_h(ADMIN))
        assert cancelled.status_code == 200, cancelled.text
        await _wait(stack, job["id"], A, "cancelled")
        # an admin key is an API key like the others, with jobs of its own
        own = await c.post("/v1/jobs", json={**body, "max_tokens": 3}, headers=_h(ADMIN))
        assert own.status_code == 202
        assert (await c.get(f"/v1/jobs/{own.json()['id']}", headers=_h(A))).status_code == 404


async def test_openai_jobs_belong_to_their_key(settings: Settings, redis: aioredis.Redis) -> None:
    async with running_stack(_keyed(settings), redis) as stack:
        c = stack.client
        body = {"model": "sim", "prompt": ["one", "two"], "max_tokens": 3}
        r = await c.post("/v1/completions", json=body, headers=_h(A))
        assert r.status_code == 200, r.text
        for job_id in r.headers["x-job-ids"].split(","):
            assert (await c.get(f"/v1/jobs/{job_id}", headers=_h(A))).status_code == 200
            assert (await c.get(f"/v1/jobs/{job_id}", headers=_h(B))).status_code == 404


async def test_idempotency_keys_are_per_owner(settings: Settings, redis: aioredis.Redis) -> None:
    async with running_stack(_keyed(settings), redis) as stack:
        c = stack.client
        idem = {"Idempotency-Key": "order-1"}
        a_body = {"model": "sim", "prompt": "from a", "max_tokens": 2}
        b_body = {"model": "sim", "prompt": "from b", "max_tokens": 2}
        a = await c.post("/v1/jobs", json=a_body, headers={**_h(A), **idem})
        b = await c.post("/v1/jobs", json=b_body, headers={**_h(B), **idem})
        # B's key is its own: no 422 saying someone else used it, no replay of A's job
        assert (a.status_code, b.status_code) == (202, 202), b.text
        assert a.json()["id"] != b.json()["id"]
        again = await c.post("/v1/jobs", json=a_body, headers={**_h(A), **idem})
        assert again.status_code == 200 and again.json()["id"] == a.json()["id"]


async def test_the_record_and_queue_entry_hold_a_hash_of_the_key_never_the_key(
    settings: Settings, redis: aioredis.Redis
) -> None:
    keyed = _keyed(settings)
    keys = Keys(keyed.key_prefix)
    async with gateway_only(keyed, redis) as client:
        r = await client.post("/v1/jobs", json={"model": "sim", "prompt": "x"}, headers=_h(A))
        job_id = r.json()["id"]
        record = await redis.hgetall(keys.job(job_id))
        [(_, entry)] = await redis.xrange(keys.queue("sim", "interactive"))
        owner = hashlib.sha256(A.encode()).hexdigest()[:32]
        assert record["owner"] == owner and entry["owner"] == owner
        stored = [*record.values(), *entry.values()]
        assert not any(A in value for value in stored)
        open_settings = Settings(**{**settings.model_dump(), "key_prefix": keyed.key_prefix})
    async with gateway_only(open_settings, redis) as client:  # keys off: one owner, anonymous
        r = await client.post("/v1/jobs", json={"model": "sim", "prompt": "x"})
        assert await redis.hget(keys.job(r.json()["id"]), "owner") == "anonymous"


async def _submit_ownerless(stack: Stack, job_id: str, created_at: float) -> None:
    """A record and queue entry as gateways wrote them before owners were recorded (no
    owner field)."""
    keys = Keys(stack.settings.key_prefix)
    spec = JobSpec(
        id=job_id,
        model="sim",
        input_ids=[1, 2],
        max_tokens=4,
        sampling=Sampling(),
        priority="interactive",
        created_at=created_at,
    )
    queued = events.QueuedEvent(
        seq=1, id=job_id, model="sim", priority="interactive", prompt_tokens=2
    )
    call = Transitions(keys).submit(
        JobRecord(spec=spec, status="queued", owner=None),
        queued_event=events.encode(queued),
        entry=QueueEntry(job=job_id, tokens=6),
        idempotency_key=None,
        idempotency_claim="",
        idempotency_ttl_s=60,
        admission=Admission(tokens=6, check_at=time.time() + 60),
    )
    await ScriptRunner(stack.redis).run(call)
    assert "owner" not in await stack.redis.hgetall(keys.job(job_id))


async def test_a_job_recorded_before_owners_runs_and_stays_visible(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """An owner-less job created before owners were recorded: a worker runs it, and its
    client (any key) still reads it, for the rest of its retention."""
    async with running_stack(_keyed(settings), redis) as stack:
        job_id = "0123456789abcdef" * 2
        await _submit_ownerless(stack, job_id, OWNERS_SINCE - 60)
        await _wait(stack, job_id, A, "succeeded")
        r = await stack.client.get(f"/v1/jobs/{job_id}/events", headers=_h(B))
        assert r.status_code == 200 and "event: done" in r.text


async def test_an_ownerless_job_created_since_owners_is_no_keys(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """A record written without an owner now (a writer's mistake) is not every key's: each
    key gets the 404 of a job that is not, and only an admin sees it."""
    async with running_stack(_keyed(settings), redis) as stack:
        job_id = "fedcba9876543210" * 2
        await _submit_ownerless(stack, job_id, time.time())
        await _wait(stack, job_id, ADMIN, "succeeded")
        for key in (A, B):
            for method, suffix in (("GET", ""), ("GET", "/events"), ("DELETE", "")):
                r = await stack.client.request(
                    method, f"/v1/jobs/{job_id}{suffix}", headers=_h(key)
                )
                assert r.status_code == 404, (key, method, suffix, r.text)
                assert r.json()["error"]["code"] == "job_not_found"


def test_admin_keys_parse_like_api_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "admins"
    path.write_text("# ops\nfile-admin\n")
    monkeypatch.setenv("GENQ_API_KEYS", "k1")
    monkeypatch.setenv("GENQ_ADMIN_KEYS", "root-1, root-2,")
    monkeypatch.setenv("GENQ_ADMIN_KEYS_FILE", str(path))
    s = GatewaySettings()
    assert s.admin_api_keys == ["root-1", "root-2", "file-admin"]
    assert s.accepted_api_keys == ["k1", "root-1", "root-2", "file-admin"]
    monkeypatch.delenv("GENQ_API_KEYS")
    monkeypatch.setenv("GENQ_ADMIN_KEYS", '["only,admin"]')
    monkeypatch.delenv("GENQ_ADMIN_KEYS_FILE")
    assert GatewaySettings().accepted_api_keys == ["only,admin"]  # admins alone close the API
