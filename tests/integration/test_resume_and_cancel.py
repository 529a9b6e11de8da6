"""Resuming a stream at or past its end, and what a job shows of its text when it is running,
cancelled or expired, and what DELETE answers. Through the gateway app and an in-process sim
worker, on real Redis and on fakeredis."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from shared.keys import Keys
from shared.schemas import ModelCard
from shared.settings import Settings
from shared.transitions import ScriptRunner, Started, Transitions
from tests.conftest import Stack, parse_sse, running_stack

STREAM_END_S = 5.0
"""A stream with nothing left to send must end well within this."""
SLOW_STEP_MS = 20
MAX_SEQ = 2**64 - 1
"""The largest seq a stream entry id holds (shared.keys.MAX_SEQ)."""


async def _log(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    keys = Keys(stack.settings.key_prefix)
    return [json.loads(f["d"]) for _, f in await stack.redis.xrange(keys.events(job_id))]


async def _log_tokens(stack: Stack, job_id: str) -> tuple[str, int]:
    """The text and token count of the job's token events."""
    tokens = [e for e in await _log(stack, job_id) if e["type"] == "token"]
    return "".join(e["text"] for e in tokens), sum(e["count"] for e in tokens)


async def _until_tokens(stack: Stack, job_id: str, n: int) -> None:
    async with asyncio.timeout(10):
        while (await _log_tokens(stack, job_id))[1] < n:
            await asyncio.sleep(0.01)


async def _events(stack: Stack, job_id: str, **request: Any) -> tuple[int, Any]:
    async with asyncio.timeout(STREAM_END_S):
        r = await stack.client.get(f"/v1/jobs/{job_id}/events", **request)
    return r.status_code, parse_sse(r.text) if r.status_code == 200 else r.json()


# ---- 13.7: resuming a finished stream ends ------------------------------------------------


async def test_resuming_at_or_past_a_finished_jobs_end_replays_the_rest_and_ends(
    stack: Stack,
) -> None:
    job = await stack.submit(prompt="resume me", max_tokens=12)
    await stack.wait_status(job["id"], "succeeded")
    _, whole = await _events(stack, job["id"])
    last = whole[-1][0]
    assert whole[-1][1] == "done"
    for seq in (last, last + 1, last + 1000, MAX_SEQ):
        for request in ({"headers": {"Last-Event-ID": str(seq)}}, {"params": {"after": seq}}):
            assert await _events(stack, job["id"], **request) == (200, []), (seq, request)
    tail = await _events(stack, job["id"], headers={"Last-Event-ID": str(last - 2)})
    assert tail == (200, whole[-2:])


async def test_resuming_past_a_running_jobs_end_ends_when_the_job_does(
    settings: Settings, redis
) -> None:  # type: ignore[no-untyped-def]
    async with running_stack(settings, redis, step_ms=SLOW_STEP_MS) as stack:
        job = await stack.submit(prompt="long", max_tokens=30)
        await stack.wait_status(job["id"], "running")
        async with asyncio.timeout(STREAM_END_S + 5):
            r = await stack.client.get(f"/v1/jobs/{job['id']}/events", params={"after": 10_000})
        assert r.status_code == 200 and parse_sse(r.text) == []
        assert (await stack.client.get(f"/v1/jobs/{job['id']}")).json()["status"] == "succeeded"


NOT_SEQS = ["1_0", "+1", "-1", "1.0", "0x1", "x", "\u0661", str(MAX_SEQ + 1)]
"""int() takes the first two and the Arabic-Indic digit; the last is past a stream id's range."""


@pytest.mark.parametrize("value", NOT_SEQS)
async def test_an_event_id_that_is_not_a_plain_seq_is_a_400(stack: Stack, value: str) -> None:
    job = await stack.submit(prompt="ids", max_tokens=30)
    await stack.wait_status(job["id"], "succeeded")
    for request, param in (
        ({"headers": {"Last-Event-ID": value.encode()}}, "Last-Event-ID"),
        ({"params": {"after": value}}, "after"),
    ):
        status, body = await _events(stack, job["id"], **request)
        assert status == 400, (value, param, body)
        assert body["error"]["param"] == param and str(MAX_SEQ) in body["error"]["message"]


async def test_after_with_blanks_is_a_400(stack: Stack) -> None:
    job = await stack.submit(prompt="ids", max_tokens=3)
    await stack.wait_status(job["id"], "succeeded")
    status, body = await _events(stack, job["id"], params={"after": " 1"})
    assert status == 400 and body["error"]["param"] == "after"


# ---- 13.19: cancel and partial output -----------------------------------------------------


async def test_delete_of_a_running_job_answers_cancelled_with_its_partial_text(
    settings: Settings, redis
) -> None:  # type: ignore[no-untyped-def]
    async with running_stack(settings, redis, step_ms=SLOW_STEP_MS) as stack:
        job = await stack.submit(prompt="long", max_tokens=1000)
        await _until_tokens(stack, job["id"], 3)
        r = await stack.client.delete(f"/v1/jobs/{job['id']}")
        assert r.status_code == 200
        answer = r.json()
        assert answer["status"] == "cancelled" and answer["cancel_requested"] is False
        text, tokens = await _log_tokens(stack, job["id"])
        assert tokens >= 3 and answer["text"] == text and answer["finish_reason"] is None
        assert answer["usage"]["completion_tokens"] == tokens
        assert answer["usage"]["total_tokens"] == tokens + answer["usage"]["prompt_tokens"]
        assert answer["timings"]["ttft_s"] is not None
        assert (await stack.client.get(f"/v1/jobs/{job['id']}")).json() == answer


async def _ghost_model(stack: Stack) -> str:
    """A model with a card and no worker: its jobs run only when the test starts them."""
    keys = Keys(stack.settings.key_prefix)
    card = dict(await stack.redis.hgetall(keys.model_card("sim")))
    card["card"] = (
        ModelCard.model_validate_json(card["card"])
        .model_copy(update={"name": "ghost"})
        .model_dump_json()
    )
    await stack.redis.hset(keys.model_card("ghost"), mapping=card)
    await stack.redis.sadd(keys.models(), "ghost")
    return "ghost"


async def test_delete_waits_a_bounded_time_then_answers_running_with_cancel_requested(
    settings: Settings, redis
) -> None:  # type: ignore[no-untyped-def]
    settings.cancel_wait_s = 0.3
    async with running_stack(settings, redis) as stack:
        job = await stack.submit(model=await _ghost_model(stack), prompt="x", max_tokens=5)
        transitions = Transitions(Keys(settings.key_prefix))
        start = transitions.start(
            job["id"], worker="gone-worker", now=time.time(), max_attempts=3, max_interruptions=5
        )
        assert isinstance(await ScriptRunner(redis).run(start), Started)
        t0 = time.monotonic()
        r = await stack.client.delete(f"/v1/jobs/{job['id']}")
        waited = time.monotonic() - t0
        assert r.status_code == 200
        answer = r.json()
        assert answer["status"] == "running" and answer["cancel_requested"] is True
        assert settings.cancel_wait_s <= waited < settings.cancel_wait_s + 2.0
        assert (await stack.client.get(f"/v1/jobs/{job['id']}")).json()["cancel_requested"]


async def test_a_running_job_shows_its_text_so_far(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    async with running_stack(settings, redis, step_ms=SLOW_STEP_MS) as stack:
        job = await stack.submit(prompt="so far", max_tokens=200, seed=3)
        await _until_tokens(stack, job["id"], 5)
        early, _ = await _log_tokens(stack, job["id"])
        view = (await stack.client.get(f"/v1/jobs/{job['id']}")).json()
        assert view["status"] == "running" and view["text_truncated"] is False
        assert view["text"].startswith(early) and view["finish_reason"] is None
        done = await stack.wait_status(job["id"], "succeeded")
        assert done["text"].startswith(view["text"]) and len(done["text"]) > len(view["text"])


async def test_the_text_so_far_is_capped_and_says_so(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    settings.partial_text_max_chars = 5
    settings.event_page_entries = 2  # several pages
    async with running_stack(settings, redis, step_ms=SLOW_STEP_MS) as stack:
        job = await stack.submit(prompt="capped", max_tokens=500)
        await _until_tokens(stack, job["id"], 8)
        view = (await stack.client.get(f"/v1/jobs/{job['id']}")).json()
        text, _ = await _log_tokens(stack, job["id"])
        assert view["text"] == text[:5] and view["text_truncated"] is True
        await stack.client.delete(f"/v1/jobs/{job['id']}")


async def test_an_expired_job_keeps_its_partial_text_and_usage(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    async with running_stack(settings, redis, step_ms=SLOW_STEP_MS) as stack:
        job = await stack.submit(prompt="late", max_tokens=5000, timeout_s=0.5)
        expired = await stack.wait_status(job["id"], "expired")
        text, tokens = await _log_tokens(stack, job["id"])
        assert tokens > 0 and expired["text"] == text and expired["finish_reason"] is None
        assert expired["usage"]["completion_tokens"] == tokens
        assert expired["error"]["code"] == "deadline_exceeded"
