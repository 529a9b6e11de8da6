"""Heavy requests against a real gateway (uvicorn, real sockets) and the OpenAI routes' own
sampler fields: CPU-bound work (tokenizing, rendering) stays off the event loop, so probes and
other clients' streams keep flowing; `extra_body` samplers reach the job."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import redis

from gateway.openai.protocol import MAX_CHAT_MESSAGES
from tests.openai.conftest import API_KEY, CHAT, GenqServer, job_spec

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BIG_PROMPT = "hello world " * 166_000
"""1,992,000 characters (under GENQ_MAX_PROMPT_CHARS), ~830,000 tokens: about a second of
tokenizing."""
STALL_LIMIT_S = 0.25
"""Longest a probe or another stream may wait while one request is heavy (it waited the
whole second when tokenizing ran on the event loop)."""
STREAM_TOKENS = 4000


@pytest.fixture
async def http(server: GenqServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


async def _worst_probe(http: httpx.AsyncClient, heavy: asyncio.Task[httpx.Response]) -> float:
    """The slowest /healthz answer while `heavy` runs."""
    worst = 0.0
    while not heavy.done():
        start = time.monotonic()
        assert (await http.get("/healthz")).status_code == 200
        worst = max(worst, time.monotonic() - start)
    return worst


async def test_a_2m_character_prompt_does_not_stall_the_gateway(http: httpx.AsyncClient) -> None:
    body = {"model": CHAT, "prompt": BIG_PROMPT, "max_tokens": 1}
    heavy = asyncio.create_task(http.post("/v1/jobs", json=body))
    worst = await _worst_probe(http, heavy)
    r = await heavy
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert worst < STALL_LIMIT_S, f"/healthz took {worst:.2f}s while a prompt was tokenized"


async def test_another_clients_stream_keeps_flowing(http: httpx.AsyncClient) -> None:
    job = {"model": CHAT, "prompt": "go", "max_tokens": STREAM_TOKENS, "stream": True}
    job["cancel_on_disconnect"] = True
    async with http.stream("POST", "/v1/jobs", json=job) as stream:
        chunks = stream.aiter_raw()
        await anext(chunks)  # the stream is flowing
        body = {"model": CHAT, "prompt": BIG_PROMPT, "max_tokens": 1}
        heavy = asyncio.create_task(http.post("/v1/jobs", json=body))
        worst, last = 0.0, time.monotonic()
        while not heavy.done():
            await anext(chunks)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        assert (await heavy).status_code == 400
    assert worst < STALL_LIMIT_S, f"a stream stalled {worst:.2f}s while a prompt was tokenized"


async def test_a_200000_message_chat_is_refused_cheaply(http: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "hi"}] * 200_000
    # encoded here, before the probes: httpx encoding 7 MB of JSON on this loop takes 0.16 s
    # of the probe's time on a 2-core box (the gateway's stall is what is measured)
    body = json.dumps({"model": CHAT, "messages": messages}).encode()
    headers = {"content-type": "application/json"}
    heavy = asyncio.create_task(http.post("/v1/chat/completions", content=body, headers=headers))
    worst = await _worst_probe(http, heavy)
    r = await heavy
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "messages" and str(MAX_CHAT_MESSAGES) in err["message"]
    assert worst < STALL_LIMIT_S, f"/healthz took {worst:.2f}s while a chat was refused"


# ---- the native API's samplers on the OpenAI routes -------------------------------------------


def test_extra_body_samplers_reach_the_job(
    client: openai.OpenAI, server: GenqServer, db: redis.Redis
) -> None:
    extra = {
        "top_k": 7,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "stop_token_ids": [3, 5],
        "priority": "batch",
        "timeout_s": 60,
    }
    raw = client.completions.with_raw_response.create(
        model=CHAT, prompt="x", max_tokens=2, extra_body=extra
    )
    [job_id] = raw.headers["x-job-ids"].split(",")
    spec = job_spec(db, server.keys, job_id)
    s = spec.sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.stop_token_ids) == (7, 0.1, 1.2, [3, 5])
    assert spec.priority == "batch"
    assert spec.deadline is not None and spec.deadline - spec.created_at == pytest.approx(60)
    chat = client.chat.completions.with_raw_response.create(
        model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=extra
    )
    [job_id] = chat.headers["x-job-ids"].split(",")
    assert job_spec(db, server.keys, job_id).sampling.top_k == 7


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"priority": "urgent"}, "priority"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_bad_sampler_values_are_refused_as_the_native_api_does(
    client: openai.OpenAI, extra: dict, param: str
) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.completions.create(model=CHAT, prompt="x", max_tokens=2, extra_body=extra)
    assert err.value.param == param


def test_stop_token_ids_outside_the_vocabulary_are_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=CHAT, prompt="x", max_tokens=2, extra_body={"stop_token_ids": [10**9]}
        )
    assert err.value.param == "stop_token_ids" and "vocabulary" in err.value.message
