"""Metrics of a real gateway app and a real worker (sim engine), in-process, on real Redis
and on fakeredis: what one job leaves in the worker's /metrics (vLLM's names, the job's own
numbers, `model`/`worker`/`gpu` labels), responses by route template, /metrics behind an
admin key when asked, and the fleet's gauges exported by exactly one of two gateways."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Message

from gateway.app import create_app
from shared.settings import Settings
from tests.conftest import gateway_only, running_stack
from worker.metrics import ITL_BUCKETS, TTFT_BUCKETS, WorkerMetrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
HANDOVER_WITHIN_S = 10.0
COUNTED_WITHIN_S = 5.0


def samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(found: Samples, name: str, **labels: str) -> float | None:
    """The sample `name` whose labels include `labels` (exactly one must match)."""
    hits = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) <= 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0] if hits else None


async def counted(metrics: WorkerMetrics, name: str, **labels: str) -> Samples:
    """The worker's samples once `name{labels}` is above 0: a job's end is counted when the
    worker has written it, a moment after its record says so."""
    async with asyncio.timeout(COUNTED_WITHIN_S):
        while True:
            found = samples((await metrics.respond()).body.decode())
            if value(found, name, **labels):
                return found
            await asyncio.sleep(0.01)


async def test_a_jobs_numbers_reach_the_workers_metrics(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    async with running_stack(settings, redis) as stack:
        job = await stack.submit(prompt="count my tokens", max_tokens=17)
        done = await stack.wait_status(job["id"], "succeeded")
        st = stack.worker.st
        found = await counted(st.metrics, "genq_request_success_total", finished_reason="length")
    usage = done["usage"]
    me = {"model": "sim", "worker": st.id}
    assert value(found, "genq_generation_tokens_total", **me) == usage["completion_tokens"] == 17
    assert value(found, "genq_prompt_tokens_total", **me) == usage["prompt_tokens"]
    assert value(found, "genq_request_success_total", finished_reason="length", **me) == 1
    assert value(found, "genq_request_success_total", finished_reason="stop", **me) == 0
    assert value(found, "genq_attempts_total", **me) == 1
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert value(found, f"genq_{name}_seconds_count", **me) == 1
    for name in ("request_prefill_time", "request_decode_time"):
        assert value(found, f"genq_{name}_seconds_count", **me) == 1
    # the first tokens' wait is the TTFT; each token after it has an inter-token latency
    assert value(found, "genq_inter_token_latency_seconds_count", **me) == 16
    assert value(found, "genq_request_generation_tokens_sum", **me) == 17
    assert value(found, "genq_request_generation_tokens_bucket", le="20.0", **me) == 1
    assert value(found, "genq_request_generation_tokens_bucket", le="10.0", **me) == 0
    # vLLM's buckets, and the timings agree with the job's own
    ttft_les = {ls for (n, ls), _ in found.items() if n.endswith("first_token_seconds_bucket")}
    assert len(ttft_les) == len(TTFT_BUCKETS) + 1  # and +Inf
    itl_les = {ls for (n, ls), _ in found.items() if n.endswith("token_latency_seconds_bucket")}
    assert len(itl_les) == len(ITL_BUCKETS) + 1
    e2e = value(found, "genq_e2e_request_latency_seconds_sum", **me)
    assert e2e is not None and 0 < e2e < 10
    assert value(found, "genq_num_requests_running", **me) == 0
    assert value(found, "genq_kv_cache_usage_perc", **me) == 0  # the sim has no pages
    assert all(dict(ls).get("gpu") is not None for (n, ls) in found if n.startswith("genq_"))


async def test_a_cancelled_job_counts_as_abort(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    async with running_stack(settings, redis, step_ms=20) as stack:
        job = await stack.submit(prompt="stop me", max_tokens=5000)
        await stack.wait_status(job["id"], "running")
        await stack.client.delete(f"/v1/jobs/{job['id']}")
        await stack.wait_status(job["id"], "cancelled")
        metrics = stack.worker.st.metrics
        found = await counted(metrics, "genq_request_success_total", finished_reason="abort")
    assert value(found, "genq_request_success_total", finished_reason="abort") == 1
    assert value(found, "genq_request_failure_total", status="failed") == 0
    assert value(found, "genq_num_requests_running") == 0


async def test_responses_count_by_route_template_and_status(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    async with gateway_only(settings, redis) as client:
        for _ in range(3):
            assert (await client.get("/v1/jobs/not-a-job")).status_code == 404
        assert (await client.get("/no/such/path")).status_code == 404
        assert (await client.post("/v1/jobs", json={"model": "sim"})).status_code == 422
        found = samples((await client.get("/metrics")).text)
    route = {"route": "/v1/jobs/{job_id}", "method": "GET", "status": "404"}
    assert value(found, "genq_http_responses_total", **route) == 3
    unmatched = {"route": "unmatched", "method": "GET", "status": "404"}
    assert value(found, "genq_http_responses_total", **unmatched) == 1
    posted = {"route": "/v1/jobs", "method": "POST", "status": "422"}
    assert value(found, "genq_http_responses_total", **posted) == 1
    assert not any("not-a-job" in str(ls) or "/no/such" in str(ls) for (_, ls) in found)


async def test_static_files_count_under_their_folder_and_the_process_is_measured(
    settings: Settings, redis
) -> None:  # type: ignore[no-untyped-def]
    async with gateway_only(settings, redis) as client:
        assert (await client.get("/dashboard/assets/dashboard.js")).status_code == 200
        assert (await client.get("/dashboard/assets/nope.js")).status_code == 404
        found = samples((await client.get("/metrics")).text)
    assets = {"route": "/dashboard/assets/{path}", "method": "GET"}
    assert value(found, "genq_http_responses_total", **assets, status="200") == 1
    assert value(found, "genq_http_responses_total", **assets, status="404") == 1
    assert value(found, "genq_http_responses_total", route="unmatched") is None
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert (value(found, name) or 0) > 0, name


async def test_metrics_are_open_unless_a_key_is_required(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    settings.api_keys = ["user-key"]
    async with gateway_only(settings, redis) as client:
        assert (await client.get("/v1/models")).status_code == 401
        r = await client.get("/metrics")  # keys on the API: the scrape stays open by default
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        refused = {"route": "/v1/models", "method": "GET", "status": "401"}
        assert value(samples(r.text), "genq_http_responses_total", **refused) == 1
    settings.admin_keys = ["admin-key"]
    settings.metrics_require_key = True
    async with gateway_only(settings, redis) as client:
        assert (await client.get("/metrics")).status_code == 401
        user = {"Authorization": "Bearer user-key"}
        r = await client.get("/metrics", headers=user)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        admin = {"Authorization": "Bearer admin-key"}
        assert (await client.get("/metrics", headers=admin)).status_code == 200


def test_requiring_a_key_without_an_admin_key_refuses_to_start(settings: Settings) -> None:
    with pytest.raises(ValueError, match="metrics_require_key needs an admin key"):
        Settings(**{**settings.model_dump(), "metrics_require_key": True, "admin_keys": []})


async def stream_then_leave(app: ASGIApp, body: dict[str, object], seen: asyncio.Event) -> None:
    """POST /v1/jobs with `body` straight to the ASGI app (httpx's transport cannot leave
    mid-answer), and disconnect once `seen` is set (by the caller, who looked meanwhile)."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/jobs",
        "raw_path": b"/v1/jobs",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(raw))],
        "client": ("127.0.0.1", 1),
        "server": ("genq", 80),
    }
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await seen.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    await app(scope, receive, send)


async def test_an_open_stream_counts_and_its_clients_leaving_is_a_disconnect(
    settings: Settings, redis
) -> None:  # type: ignore[no-untyped-def]
    async with gateway_only(settings, redis) as client:  # no worker: the job stays queued
        app = client._transport.app  # type: ignore[attr-defined]
        seen = asyncio.Event()
        body = {"model": "sim", "prompt": "wait", "stream": True}
        stream = asyncio.create_task(stream_then_leave(app, body, seen))
        async with asyncio.timeout(COUNTED_WITHIN_S):
            while value(samples((await client.get("/metrics")).text), "genq_sse_streams_open") != 1:
                await asyncio.sleep(0.01)
        seen.set()
        await stream
        found = samples((await client.get("/metrics")).text)
    assert value(found, "genq_sse_streams_open") == 0
    assert value(found, "genq_client_disconnects_total", route="/v1/jobs") == 1
    posted = {"route": "/v1/jobs", "method": "POST", "status": "200"}
    assert value(found, "genq_http_responses_total", **posted) == 1


@contextlib.asynccontextmanager
async def gateway(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://genq") as client:
            yield client


async def _exports_fleet(client: httpx.AsyncClient) -> bool:
    text = (await client.get("/metrics")).text
    return "genq_queue_length{" in text


async def test_one_of_two_gateways_exports_the_fleet_and_a_closing_one_hands_over(
    settings: Settings, redis
) -> None:  # type: ignore[no-untyped-def]
    settings.metrics_fleet_interval_s = 0.05
    # far longer than the test waits: the other gateway takes over because the lease is freed
    settings.metrics_fleet_lease_s = 60.0
    settings.queue_models = ["sim"]
    stacks = [contextlib.AsyncExitStack(), contextlib.AsyncExitStack()]
    try:
        clients = []
        for s in stacks:
            app = create_app(settings, redis=redis, raw_pubsub=False)
            clients.append(await s.enter_async_context(gateway(app)))
        async with asyncio.timeout(HANDOVER_WITHIN_S):
            while not any([await _exports_fleet(c) for c in clients]):
                await asyncio.sleep(0.02)
        for _ in range(10):  # never both, round after round
            assert [await _exports_fleet(c) for c in clients].count(True) == 1
            await asyncio.sleep(settings.metrics_fleet_interval_s)
        holder = 0 if await _exports_fleet(clients[0]) else 1
        found = samples((await clients[holder].get("/metrics")).text)
        assert value(found, "genq_queue_lag", model="sim", priority="interactive") == 0
        assert value(found, "genq_queue_length", model="sim", priority="batch") == 0
        assert value(found, "genq_dead_letters") == 0
        await stacks[holder].aclose()
        async with asyncio.timeout(HANDOVER_WITHIN_S):
            while not await _exports_fleet(clients[1 - holder]):
                await asyncio.sleep(0.02)
    finally:
        for s in stacks:
            await s.aclose()


async def test_prefix_cache_hits_reach_usage_and_the_metrics(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    """The same long prompt twice on a sim with a prefix cache: the second job's usage counts
    its cached pages, and the worker's hit counters and ratio say so."""
    prompt = " ".join(["the model queue worker gateway"] * 120)  # > 2 pages of 256 tokens
    async with running_stack(settings, redis, cache_tokens=4096) as stack:
        first = await stack.submit(prompt=prompt, max_tokens=3)
        one = await stack.wait_status(first["id"], "succeeded")
        second = await stack.submit(prompt=prompt, max_tokens=3)
        two = await stack.wait_status(second["id"], "succeeded")
        st = stack.worker.st
        me = {"model": "sim", "worker": st.id}
        found = await counted(st.metrics, "genq_prefix_cache_hits_total", **me)
    assert one["usage"]["cached_tokens"] == 0
    cached = two["usage"]["cached_tokens"]
    assert cached >= 512 and cached % 256 == 0
    prompts = one["usage"]["prompt_tokens"] + two["usage"]["prompt_tokens"]
    assert value(found, "genq_prefix_cache_hits_total", **me) == cached
    assert value(found, "genq_prefix_cache_queries_total", **me) == prompts
    assert value(found, "genq_prefix_cache_hit_ratio", **me) == pytest.approx(cached / prompts)
