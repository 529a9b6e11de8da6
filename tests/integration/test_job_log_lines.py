"""The job step lines of the ends that the end-to-end test does not reach (a poison job's
failed attempts, requeues and dead letter; cancels of queued and running jobs; a deadline),
and the access line's job ids for a request that starts several jobs, through the gateway app
and an in-process sim worker."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.access_log import MAX_JOB_IDS, AccessLog, touched_job
from shared.settings import Settings
from tests.conftest import running_stack

LONG = 5000
"""Tokens: at 1 ms a step, seconds of work."""
BATCH_END_S = 20.0


def _lines(caplog: pytest.LogCaptureFixture, msg: str, job_id: str) -> list[dict[str, Any]]:
    return [
        r.__dict__
        for r in caplog.records
        if r.getMessage() == msg and r.__dict__.get("job_id") == job_id
    ]


async def test_a_poison_job_logs_each_attempt_its_requeues_and_its_dead_letter(
    settings: Settings, redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="worker.joblog")  # "job started" is a debug line
    async with running_stack(settings, redis, poison_marker="POISON") as stack:
        poison = await stack.submit(prompt="a POISON pill", max_tokens=20)
        await stack.wait_status(poison["id"], "failed")
        worker_id = stack.worker.st.id
    attempts = settings.max_attempts
    started = _lines(caplog, "job started", poison["id"])
    assert [s["attempt"] for s in started] == list(range(1, attempts + 1))
    requeued = _lines(caplog, "job requeued", poison["id"])
    assert [r["attempt"] for r in requeued] == list(range(1, attempts + 1))
    assert all(r["counted"] and "poison marker" in r["why"] for r in requeued)
    assert all(r["worker_id"] == worker_id for r in started + requeued)
    [dead] = _lines(caplog, "job dead-lettered", poison["id"])
    assert dead["levelname"] == "WARNING" and dead["attempts"] == attempts
    assert not _lines(caplog, "job finished", poison["id"])
    assert stack.worker.st.counts.dead_lettered == 1
    assert stack.worker.st.counts.requeued == attempts


async def test_cancels_and_a_deadline_are_logged_where_they_happen(
    settings: Settings, redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with running_stack(settings.model_copy(update={"max_batch": 1}), redis) as stack:
        running = await stack.submit(prompt="the model", max_tokens=LONG)
        await stack.wait_status(running["id"], "running")
        queued = await stack.submit(prompt="the model", max_tokens=10)
        await stack.client.delete(f"/v1/jobs/{queued['id']}")
        await stack.client.delete(f"/v1/jobs/{running['id']}")
        ended = await stack.wait_status(running["id"], "cancelled")
        overdue = await stack.submit(prompt="the model", max_tokens=LONG, timeout_s=0.3)
        expired = await stack.wait_status(overdue["id"], "expired", timeout=5)
    [at_gateway] = _lines(caplog, "job cancelled", queued["id"])
    assert at_gateway["name"] == "gateway.job_service" and at_gateway["status"] == "queued"
    [at_worker] = _lines(caplog, "job cancelled", running["id"])
    assert at_worker["name"] == "worker.joblog" and at_worker["reason"] == "cancelled"
    assert at_worker["generation_tokens"] == ended["usage"]["completion_tokens"] > 0
    [late] = _lines(caplog, "job expired", overdue["id"])
    assert late["code"] == "deadline_exceeded" and late["levelname"] == "INFO"
    assert late["generation_tokens"] == expired["usage"]["completion_tokens"]


async def test_the_access_line_names_every_job_a_request_started(
    settings: Settings, redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access_log")
    async with running_stack(settings, redis) as stack:
        body = {"model": "sim", "prompt": ["one", "two"], "n": 2, "max_tokens": 3}
        r = await stack.client.post("/v1/completions", json=body)
        assert r.status_code == 200
        missing = await stack.client.get("/v1/no/such/route")
    lines = [r.__dict__ for r in caplog.records if r.name == "gateway.access_log"]
    [line] = [x for x in lines if x["route"] == "/v1/completions"]
    assert line["job_ids"] == r.headers["x-job-ids"].split(",") and line["jobs"] == 4
    assert "job_id" not in line
    [unmatched] = [x for x in lines if x["status"] == missing.status_code == 404]
    assert unmatched["route"] == "/v1/no/such/route"


async def test_a_request_names_at_most_max_job_ids_and_only_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def many(request: Request) -> PlainTextResponse:
        for i in range(int(request.query_params["n"])):
            touched_job(f"{request.query_params['tag']}-{i}")
        return PlainTextResponse("ok")

    app = AccessLog(Starlette(routes=[Route("/many/{tag}", many)]))
    caplog.set_level(logging.INFO, logger="gateway.access_log")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        await client.get("/many/a", params={"n": MAX_JOB_IDS + 8, "tag": "a"})
        await client.get("/many/b", params={"n": 1, "tag": "b"})
    first, second = (r.__dict__ for r in caplog.records)
    assert first["route"] == "/many/{tag}" and first["jobs"] == MAX_JOB_IDS + 8
    assert first["job_ids"] == [f"a-{i}" for i in range(MAX_JOB_IDS)]
    assert second["job_id"] == "b-0" and "job_ids" not in second
    touched_job("outside any request")  # nothing to note it in: no error


async def test_a_batch_that_is_only_long_is_never_called_stalled(
    settings: Settings, redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Its lines resolve slower than GENQ_BATCH_SWEEP_S: the sweep runs (a debug line) and
    nothing says the batch is stalled, at any level."""
    caplog.set_level(logging.DEBUG, logger="gateway.batch")
    quick = settings.model_copy(update={"batch_sweep_s": 0.1, "batch_poll_s": 0.05})
    line = {"method": "POST", "url": "/v1/completions"}
    body = {"model": "sim", "prompt": "the model", "max_tokens": 600}  # 1 ms steps: 0.6 s
    data = "".join(json.dumps({**line, "custom_id": f"l{i}", "body": body}) + "\n" for i in (0, 1))
    async with running_stack(quick, redis) as stack:
        files = {"file": ("long.jsonl", data.encode())}
        f = await stack.client.post("/v1/files", files=files, data={"purpose": "batch"})
        created = await stack.client.post(
            "/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions"}
        )
        batch_id = created.json()["id"]
        async with asyncio.timeout(BATCH_END_S):
            while (await stack.client.get(f"/v1/batches/{batch_id}")).json()[
                "status"
            ] != "completed":
                await asyncio.sleep(0.05)
    said = [r for r in caplog.records if r.__dict__.get("batch_id") == batch_id]
    assert any(r.getMessage().startswith("batch sweep") for r in said)  # it was quiet a while
    assert not [r.getMessage() for r in caplog.records if "stall" in r.getMessage().lower()]
