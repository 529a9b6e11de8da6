"""The native job API through the gateway app and an in-process sim worker, on real Redis
and on fakeredis."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.registry import STARTING_RETRY_S
from tests.conftest import Stack, gateway_only, parse_sse, running_stack


async def test_job_runs_to_completion_and_reports_result(stack: Stack) -> None:
    job = await stack.submit(prompt="the model", max_tokens=12, seed=7, metadata={"user": "u1"})
    assert job["status"] == "queued"
    done = await stack.wait_status(job["id"], "succeeded")
    assert done["finish_reason"] == "length"
    assert done["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 12,
        "total_tokens": 14,
        "cached_tokens": 0,
    }
    assert done["text"] and done["attempt"] == 1 and done["worker"] == stack.worker.st.id
    assert done["metadata"] == {"user": "u1"}
    t = done["timings"]
    assert 0 <= t["queue_s"] <= t["ttft_s"] and t["generation_s"] >= 0


async def test_streamed_text_equals_result(stack: Stack) -> None:
    r = await stack.client.post(
        "/v1/jobs", json={"model": "sim", "prompt": "hello", "max_tokens": 30, "stream": True}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert events[0][1] == "queued" and events[1][1] == "started" and events[-1][1] == "done"
    text = "".join(e[2]["text"] for e in events if e[1] == "token")
    assert sum(e[2]["count"] for e in events if e[1] == "token") == 30
    job = await stack.wait_status(r.headers["x-job-id"], "succeeded")
    assert job["text"] == text


async def test_same_request_and_seed_gives_same_text(stack: Stack) -> None:
    a = await stack.submit(prompt="same", max_tokens=20, seed=3)
    b = await stack.submit(prompt="same", max_tokens=20, seed=3)
    c = await stack.submit(prompt="same", max_tokens=20, seed=4)
    texts = [(await stack.wait_status(j["id"], "succeeded"))["text"] for j in (a, b, c)]
    assert texts[0] == texts[1] != texts[2]


async def test_events_replay_and_resume_with_last_event_id(stack: Stack) -> None:
    job = await stack.submit(prompt="resume me", max_tokens=25)
    await stack.wait_status(job["id"], "succeeded")
    whole = parse_sse((await stack.client.get(f"/v1/jobs/{job['id']}/events")).text)
    tail = parse_sse(
        (
            await stack.client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": "5"})
        ).text
    )
    assert tail == whole[5:]
    assert [e[0] for e in whole] == list(range(1, len(whole) + 1))


async def test_stop_strings_end_the_job(stack: Stack) -> None:
    ref = await stack.submit(prompt="stop test", max_tokens=40, seed=1)
    text = (await stack.wait_status(ref["id"], "succeeded"))["text"]
    stop = text.split()[4]
    job = await stack.submit(prompt="stop test", max_tokens=40, seed=1, stop=[stop])
    done = await stack.wait_status(job["id"], "succeeded")
    assert done["finish_reason"] == "stop"
    assert stop not in done["text"] and text.startswith(done["text"])


async def test_idempotency_key_returns_the_same_job(stack: Stack) -> None:
    body = {"model": "sim", "prompt": "once", "max_tokens": 5}
    headers = {"Idempotency-Key": "order-42"}
    first = await stack.client.post("/v1/jobs", json=body, headers=headers)
    again = await stack.client.post("/v1/jobs", json=body, headers=headers)
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    other = await stack.client.post("/v1/jobs", json={**body, "prompt": "twice"}, headers=headers)
    assert other.status_code == 422
    assert other.json()["error"]["param"] == "Idempotency-Key"
    queue = stack.worker.st.queues["interactive"]
    await stack.wait_status(first.json()["id"], "succeeded")
    async with asyncio.timeout(5):  # one job ran, and its entry goes (acked after its end)
        while await stack.redis.xlen(queue):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model", ["nope"]),
        ({"model": "sim", "prompt": "x", "max_tokens": 0}, 422, "max_tokens", ["greater"]),
        ({"model": "sim", "prompt": "x", "max_tokens": 9000}, 400, "max_tokens", ["8192", "9001"]),
        ({"model": "sim", "prompt": "x " * 9000}, 400, "prompt", ["8192"]),
        ({"model": "sim", "prompt": "x", "temperature": 11}, 422, "temperature", ["10"]),
        ({"model": "sim", "prompt": "x", "top_p": 2}, 422, "top_p", ["1"]),
        ({"model": "sim", "prompt": "x", "priority": "now"}, 422, "priority", ["batch"]),
        ({"model": "sim", "prompt": "x", "stop": "a"}, 422, "stop", ["list"]),
        ({"model": "sim", "prompt": "x", "bogus": 1}, 422, "bogus", ["not permitted"]),
        ({"model": "sim"}, 422, "prompt", ["exactly one"]),
        ({"model": "sim", "input_ids": [1, 10**9]}, 400, "input_ids", ["vocabulary"]),
        ({"model": "sim", "prompt": "x", "logit_bias": {"4096": 1}}, 400, "logit_bias", ["4096"]),
        ({"model": "sim", "prompt": "x", "logit_bias": {"1e3": 1}}, 422, "logit_bias.1e3", ["id"]),
        ({"model": "sim", "prompt": "x", "logit_bias": {"9": -101}}, 422, "logit_bias.9", ["100"]),
        (
            {"model": "sim", "prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}},
            422,
            "logit_bias",
            ["1024"],
        ),
        (
            {"model": "sim", "prompt": "x", "max_tokens": 3, "min_tokens": 4},
            400,
            "min_tokens",
            ["3"],
        ),
        (
            {"model": "sim", "prompt": "x", "banned_strings": ["x"] * 17},
            422,
            "banned_strings",
            ["16"],
        ),
        (
            {"model": "sim", "prompt": "x", "metadata": {"k": "v" * 20000}},
            400,
            "metadata",
            ["16384"],
        ),
        ({"prompt": "x"}, 422, "model", ["required"]),
    ],
)
async def test_bad_input_gets_4xx_naming_field_and_limit(
    stack: Stack, body: dict, status: int, param: str, words: list[str]
) -> None:
    r = await stack.client.post("/v1/jobs", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    for w in words:
        assert w in err["message"]
    assert await stack.redis.xlen(stack.worker.st.queues["interactive"]) == 0  # nothing queued


async def test_malformed_json_and_unknown_job(stack: Stack) -> None:
    r = await stack.client.post(
        "/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400  # unparsable, as a body of bad UTF-8 is (not 422: invalid)
    assert r.json()["error"]["param"] == "body"
    assert (await stack.client.get("/v1/jobs/0123456789abcdef0123456789abcdef")).status_code == 404
    assert (await stack.client.get("/v1/jobs/../../etc")).status_code == 404
    assert (await stack.client.delete("/v1/jobs/nothex")).status_code == 404
    bad = await stack.client.get(
        "/v1/jobs/0123456789abcdef0123456789abcdef/events", headers={"Last-Event-ID": "x"}
    )
    assert bad.status_code == 404  # the job is looked up first


async def test_cancel_running_job_frees_its_slot_within_a_second(settings, redis) -> None:  # type: ignore[no-untyped-def]
    settings.max_batch = 1
    async with running_stack(settings, redis, step_ms=50) as stack:
        long = await stack.submit(prompt="long", max_tokens=1000)
        await stack.wait_status(long["id"], "running")
        queued = await stack.submit(prompt="next", max_tokens=3)
        t0 = time.monotonic()
        r = await stack.client.delete(f"/v1/jobs/{long['id']}")
        assert r.status_code == 200
        cancelled = await stack.wait_status(long["id"], "cancelled", timeout=1.0)
        await stack.wait_status(queued["id"], "running", "succeeded", timeout=1.0)
        assert time.monotonic() - t0 < 1.0
        events = parse_sse((await stack.client.get(f"/v1/jobs/{long['id']}/events")).text)
        assert events[-1][1] == "cancelled"
        assert cancelled["finished_at"] is not None
        again = await stack.client.delete(f"/v1/jobs/{long['id']}")
        assert again.status_code == 409


async def test_cancel_queued_job_never_runs(settings, redis) -> None:  # type: ignore[no-untyped-def]
    settings.max_batch = 1
    async with running_stack(settings, redis, step_ms=20) as stack:
        busy = await stack.submit(prompt="busy", max_tokens=30)
        waiting = await stack.submit(prompt="waiting", max_tokens=5)
        r = await stack.client.delete(f"/v1/jobs/{waiting['id']}")
        assert r.json().get("status") == "cancelled", r.text
        await stack.wait_status(busy["id"], "succeeded")
        after = await stack.submit(prompt="after", max_tokens=2)
        await stack.wait_status(after["id"], "succeeded")
        job = (await stack.client.get(f"/v1/jobs/{waiting['id']}")).json()
        assert job["status"] == "cancelled" and job["attempt"] == 0 and job["text"] is None
        events = parse_sse((await stack.client.get(f"/v1/jobs/{waiting['id']}/events")).text)
        assert [e[1] for e in events] == ["queued", "cancelled"]


async def test_interactive_is_admitted_before_batch_and_batch_still_progresses(
    settings, redis
) -> None:  # type: ignore[no-untyped-def]
    settings.max_batch = 1
    settings.batch_share = 3
    async with running_stack(settings, redis, step_ms=5) as stack:
        blocker = await stack.submit(prompt="block", max_tokens=20)
        await stack.wait_status(blocker["id"], "running")
        batch = [
            await stack.submit(prompt=f"b{i}", max_tokens=2, priority="batch") for i in range(3)
        ]
        inter = [await stack.submit(prompt=f"i{i}", max_tokens=2) for i in range(6)]
        ids = [j["id"] for j in batch + inter]
        for i in ids:
            await stack.wait_status(i, "succeeded")
        started = {i: (await stack.client.get(f"/v1/jobs/{i}")).json()["started_at"] for i in ids}
        order = sorted(ids, key=lambda i: started[i])
        first_batch = min(order.index(j["id"]) for j in batch)
        assert order[0] == inter[0]["id"]  # interactive jumps the batch backlog
        assert first_batch <= 3  # …but every `batch_share` claims a batch job gets a turn


async def test_models_health_and_readiness(stack: Stack) -> None:
    models = (await stack.client.get("/v1/models")).json()
    assert models["object"] == "list"
    [sim] = models["data"]
    assert sim["id"] == "sim" and sim["simulated"] is True and sim["workers"] == 1
    assert (await stack.client.get("/v1/models/sim")).status_code == 200
    assert (await stack.client.get("/v1/models/other")).status_code == 404
    assert (await stack.client.get("/healthz")).json() == {"status": "ok"}
    assert (await stack.client.get("/readyz")).json()["status"] == "ready"


async def test_a_configured_model_not_registered_yet_is_a_503_starting(settings, redis) -> None:  # type: ignore[no-untyped-def]
    """GENQ_QUEUE_MODELS names a model that is starting (`genq serve` names its own): until a
    worker registers it, a request for it is a 503 to retry, not a 404 calling it unknown."""
    settings.queue_models = ["starting"]
    async with gateway_only(settings, redis) as client:
        r = await client.post("/v1/jobs", json={"model": "starting", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_starting"
        assert r.headers["Retry-After"] == str(STARTING_RETRY_S)
        other = await client.post("/v1/jobs", json={"model": "other", "prompt": "x"})
        assert other.status_code == 404


async def test_api_keys_are_enforced(settings, redis) -> None:  # type: ignore[no-untyped-def]
    settings.api_keys = ["k1"]
    async with running_stack(settings, redis) as stack:
        r = await stack.client.post("/v1/jobs", json={"model": "sim", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = await stack.client.post(
            "/v1/jobs", json={"model": "sim", "prompt": "x"}, headers={"Authorization": "Bearer k1"}
        )
        assert ok.status_code == 202
        assert (await stack.client.get("/healthz")).status_code == 200


async def test_many_concurrent_streams_each_get_their_whole_text(stack: Stack) -> None:
    async def one(i: int) -> tuple[str, str]:
        r = await stack.client.post(
            "/v1/jobs",
            json={"model": "sim", "prompt": f"p{i}", "max_tokens": 40, "seed": i, "stream": True},
        )
        events = parse_sse(r.text)
        assert [e[0] for e in events] == list(range(1, len(events) + 1))
        return r.headers["x-job-id"], "".join(e[2]["text"] for e in events if e[1] == "token")

    results = await asyncio.gather(*(one(i) for i in range(40)))
    for job_id, text in results:
        assert (await stack.client.get(f"/v1/jobs/{job_id}")).json()["text"] == text
