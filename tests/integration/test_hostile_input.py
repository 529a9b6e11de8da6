"""Hostile and odd requests against the gateway app (in-process, real Redis, a sim worker):
each gets a 4xx in the documented shape `{"error": {message, type, param, code}}` naming the
field and the limit, never a 5xx; bodies are bounded and keys checked before a body is read."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from urllib.parse import quote

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError
from starlette.requests import Request

from gateway.openai.protocol import MAX_CHAT_MESSAGES, ChatCompletionRequest
from shared.schemas import MAX_METADATA_DEPTH, MAX_SEED
from shared.settings import Settings
from tests.conftest import REDIS_URL, Stack, running_stack
from worker.sim import SimEngine

JSON = {"content-type": "application/json"}
BODY_LIMIT = 4096
CHUNK = b" " * 1024
CHUNKS = 64
"""A chunked body of 64 KiB, sent 1 KiB at a time, against a 4 KiB limit."""


@pytest.fixture
async def real_redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def stack(settings: Settings, real_redis: aioredis.Redis) -> AsyncIterator[Stack]:
    async with running_stack(settings, real_redis) as s:
        yield s


@pytest.fixture
async def small(settings: Settings, real_redis: aioredis.Redis) -> AsyncIterator[Stack]:
    """A gateway whose body limit is BODY_LIMIT."""
    settings.max_body_bytes = BODY_LIMIT
    async with running_stack(settings, real_redis) as s:
        yield s


def error_of(r: object, status: int) -> dict:
    """The error object of a response, after checking its status and the documented shape."""
    assert r.status_code == status, r.text  # type: ignore[attr-defined]
    body = r.json()  # type: ignore[attr-defined]
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


class CountedBody:
    """A request body sent in chunks, counting how many the server pulled."""

    def __init__(self, head: bytes = b'{"model": "sim", "prompt": "') -> None:
        self.head = head
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.head
        for _ in range(CHUNKS):
            self.sent += 1
            yield CHUNK
        yield b'"}'


# ---- item 4: body size and authentication before the body --------------------------------


async def test_a_body_over_the_limit_is_413_naming_it(small: Stack) -> None:
    big = json.dumps({"model": "sim", "prompt": "x" * (2 * BODY_LIMIT)})
    err = error_of(await small.client.post("/v1/jobs", content=big, headers=JSON), 413)
    assert str(BODY_LIMIT) in err["message"] and "GENQ_MAX_BODY_BYTES" in err["message"]
    assert err["param"] == "body" and err["code"] == "payload_too_large"


async def test_a_chunked_body_is_cut_off_once_past_the_limit(small: Stack) -> None:
    body = CountedBody()
    r = await small.client.post("/v1/jobs", content=body, headers=JSON)  # no Content-Length
    assert error_of(r, 413)["code"] == "payload_too_large"
    assert body.sent <= BODY_LIMIT // len(CHUNK) + 1  # the rest was never read


async def test_a_missing_key_is_refused_before_the_body_is_read(
    settings: Settings, real_redis: aioredis.Redis
) -> None:
    settings.api_keys = ["k1"]
    async with running_stack(settings, real_redis) as stack:
        body = CountedBody()
        r = await stack.client.post("/v1/jobs", content=body, headers=JSON)
        assert error_of(r, 401)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert body.sent == 0
        assert (await stack.client.get("/healthz")).status_code == 200  # probes need no key


# ---- item 8: content that used to be a 500 ----------------------------------------------


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "sim", "prompt": "a\\ud800b"}', "prompt"),
        (b'{"model": "sim", "prompt": "ab", "metadata": {"k": ["\\udc00"]}}', "metadata.k.0"),
        (b'{"model": "sim", "prompt": "ab", "stop": ["\\udbff"]}', "stop.0"),
    ],
)
async def test_lone_surrogates_are_refused_naming_the_field(
    stack: Stack, raw: bytes, param: str
) -> None:
    err = error_of(await stack.client.post("/v1/jobs", content=raw, headers=JSON), 422)
    # typed strings: pydantic's own "unable to parse … as a unicode string"; others: genq's
    assert err["param"] == param and ("surrogate" in err["message"] or "unicode" in err["message"])


async def test_lone_surrogates_in_chat_content_are_refused(stack: Stack) -> None:
    raw = b'{"model": "sim", "messages": [{"role": "user", "content": "\\ud800"}]}'
    r = await stack.client.post("/v1/chat/completions", content=raw, headers=JSON)
    assert error_of(r, 422)["param"] == "messages.0.content"


@pytest.mark.parametrize("depth", [MAX_METADATA_DEPTH + 1, 256, 600, 980])
async def test_deeply_nested_metadata_is_a_400(stack: Stack, depth: int) -> None:
    raw = b'{"model": "sim", "prompt": "x", "metadata": ' + b'{"a": ' * depth + b"1" + b"}" * depth
    err = error_of(await stack.client.post("/v1/jobs", content=raw + b"}", headers=JSON), 400)
    if err["param"] == "metadata":
        assert f"{depth} levels deep; the limit is {MAX_METADATA_DEPTH}" in err["message"]
    else:  # deeper than this process's JSON parser goes
        assert err["param"] == "body" and "nested too deeply" in err["message"]


# ---- item 9: one error shape everywhere ---------------------------------------------------


async def test_unknown_routes_and_wrong_methods_answer_in_the_error_shape(stack: Stack) -> None:
    assert error_of(await stack.client.get("/nope"), 404)["code"] == "not_found"
    r = await stack.client.put("/v1/jobs")
    assert error_of(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    r = await stack.client.options(f"/v1/jobs/{'a' * 32}")
    assert error_of(r, 405)["message"].endswith("allowed: DELETE, GET")
    assert r.headers["allow"] == "DELETE, GET"  # both routes of the path, not the first's only


@pytest.mark.parametrize("api", ["embeddings", "conversations", "moderations", "audio/speech"])
async def test_openai_apis_genq_does_not_serve_are_a_404_saying_so(stack: Stack, api: str) -> None:
    err = error_of(await stack.client.post(f"/v1/{api}", json={"model": "sim"}), 404)
    assert err["code"] == "unsupported_endpoint" and api.split("/")[0] in err["message"]


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"model": "sim", "prompt": "\xff"}', "UTF-8"),
        (b'{"model": "sim", "prompt": "x", "seed": ' + b"1" * 5000 + b"}", "4300 digits"),
        (b'{"model": "sim", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b'{"model": "sim", "prompt": "x"', "not valid JSON"),
    ],
)
async def test_bodies_that_do_not_parse_are_a_400_on_the_body(
    stack: Stack, raw: bytes, words: str
) -> None:
    err = error_of(await stack.client.post("/v1/jobs", content=raw, headers=JSON), 400)
    assert err["param"] == "body" and words in err["message"], err


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/completions", "/v1/batches"])
async def test_a_body_that_is_not_utf8_is_a_400_as_documented(
    stack: Stack, encoding: str, path: str
) -> None:
    body = {"model": "sim", "prompt": "x", "max_tokens": 1}
    raw = json.dumps(body).encode(encoding)
    err = error_of(await stack.client.post(path, content=raw, headers=JSON), 400)
    assert err["param"] == "body" and "not UTF-8" in err["message"], err


async def test_a_utf8_byte_order_mark_is_tolerated(stack: Stack) -> None:
    raw = b"\xef\xbb\xbf" + json.dumps({"model": "sim", "prompt": "x", "max_tokens": 1}).encode()
    assert (await stack.client.post("/v1/jobs", content=raw, headers=JSON)).status_code == 202


async def test_union_errors_name_the_field_a_person_wrote(stack: Stack) -> None:
    body = {"model": "sim", "prompt": "x", "stop": 5}
    err = error_of(await stack.client.post("/v1/completions", json=body), 422)
    assert err["param"] == "stop" and "constrained" not in err["message"]
    body = {"model": "sim", "prompt": [["a"]]}
    err = error_of(await stack.client.post("/v1/completions", json=body), 422)
    assert err["param"].startswith("prompt") and "[" not in err["message"]


# ---- item 10: the message without max_tokens ----------------------------------------------


async def test_an_over_long_prompt_without_max_tokens_names_only_prompt_and_context(
    stack: Stack,
) -> None:
    body = {"model": "sim", "prompt": "word " * 9000}
    err = error_of(await stack.client.post("/v1/jobs", json=body), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "max_tokens" not in err["message"] and "-" not in err["message"]
    assert "8192" in err["message"]


async def test_without_max_tokens_a_long_prompt_gets_what_the_context_leaves(
    stack: Stack,
) -> None:
    stack.settings.default_max_tokens = 100_000
    job = await stack.submit(prompt="word " * 4000)  # 8002 tokens
    done = await stack.wait_status(job["id"], "succeeded", timeout=30)
    assert done["usage"]["total_tokens"] == 8192  # the whole context, and not a 400


# ---- item 11: types the document states ----------------------------------------------------


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/jobs", {"prompt": "x", "top_p": True}, "top_p"),
        ("/v1/jobs", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("/v1/jobs", {"input_ids": [True]}, "input_ids.0"),
        ("/v1/jobs", {"prompt": ""}, "prompt"),
        ("/v1/jobs", {"prompt": None, "input_ids": None}, "prompt"),
        ("/v1/completions", {"prompt": [[False]]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 1}]}, "messages"),
    ],
)
async def test_values_of_the_wrong_json_type_are_refused(
    stack: Stack, path: str, extra: dict, param: str
) -> None:
    err = error_of(await stack.client.post(path, json={"model": "sim", **extra}), 422)
    assert err["param"].startswith(param), err


async def test_integral_numbers_and_the_largest_seed_are_taken(stack: Stack) -> None:
    job = await stack.submit(prompt="x", max_tokens=3.0, seed=MAX_SEED, top_k=40.0)
    assert (await stack.wait_status(job["id"], "succeeded"))["usage"]["completion_tokens"] == 3
    err = error_of(await stack.client.post("/v1/jobs", json=_job(seed=MAX_SEED + 1)), 422)
    assert err["param"] == "seed" and str(MAX_SEED) in err["message"]


def _job(**fields: object) -> dict:
    return {"model": "sim", "prompt": "x", "max_tokens": 1, **fields}


async def test_the_document_says_sse_for_streams_and_lists_error_statuses(stack: Stack) -> None:
    doc = (await stack.client.get("/openapi.json")).json()
    events = doc["paths"]["/v1/jobs/{job_id}/events"]["get"]["responses"]
    assert list(events["200"]["content"]) == ["text/event-stream"]
    assert list(events["404"]["content"]) == ["application/json"]
    submit = doc["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"200", "202", "400", "401", "404", "409", "413", "422", "429", "503"} <= set(submit)
    assert "text/event-stream" in submit["200"]["content"]
    job = doc["components"]["schemas"]["JobCreate"]
    assert seed_maximum(job) == MAX_SEED  # exactly: a double holds it
    assert [one["required"] for one in job["oneOf"]] == [["prompt"], ["input_ids"]]


def seed_maximum(schema: dict) -> int:
    return int(schema["properties"]["seed"]["anyOf"][0]["maximum"])


# ---- item 12: what errors echo, and stop_token_ids -------------------------------------------


@pytest.mark.parametrize("name", ["x\x01\x1b[31m" * 2000, "n" * 10_000])
async def test_echoed_names_are_cut_and_escaped(stack: Stack, name: str) -> None:
    r = await stack.client.post("/v1/jobs", json={"model": name[:256], "prompt": "x"})
    err = error_of(r, 404)
    assert len(err["message"]) < 200 and not any(ord(c) < 32 for c in err["message"])
    r = await stack.client.get(f"/v1/models/{quote(name)}")
    err = error_of(r, 404)
    assert len(err["message"]) < 200 and not any(ord(c) < 32 for c in err["message"])


async def test_stop_token_ids_are_bounded_by_the_vocabulary(stack: Stack) -> None:
    err = error_of(await stack.client.post("/v1/jobs", json=_job(stop_token_ids=[10**9])), 400)
    assert err["param"] == "stop_token_ids" and "vocabulary" in err["message"]


async def test_a_job_id_with_a_trailing_newline_is_no_job(stack: Stack) -> None:
    """`^[0-9a-f]{32}$` let `<id>\\n` through (`$` matches before a final newline): the id
    must be the whole string, on every route of a job."""
    job_id = (await stack.submit(prompt="x", max_tokens=2))["id"]
    assert (await stack.client.get(f"/v1/jobs/{job_id}")).status_code == 200
    for path in (
        f"/v1/jobs/{quote(job_id + chr(10))}",
        f"/v1/jobs/{quote(job_id + chr(10))}/events",
    ):
        err = error_of(await stack.client.get(path), 404)
        assert err["param"] == "id" and "\n" not in err["message"]
    err = error_of(await stack.client.delete(f"/v1/jobs/{quote(job_id + chr(10))}"), 404)
    assert err["param"] == "id"


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry for each body Starlette parses as JSON (`Request.json`) from now on."""
    seen: list[int] = []
    json_of = Request.json

    async def counting(self: Request) -> object:
        seen.append(1)
        return await json_of(self)

    monkeypatch.setattr(Request, "json", counting)
    return seen


@pytest.mark.parametrize("extra", [1, 190_000])
async def test_a_chat_over_its_message_limit_is_refused_before_the_body_is_parsed(
    stack: Stack, parsed: list[int], extra: int
) -> None:
    """The count comes from a raw scan: Starlette's `json.loads` (and pydantic after it) never
    sees the messages, and the 422 is the one pydantic gives for the same body."""
    messages = [{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + extra)
    r = await stack.client.post("/v1/chat/completions", json={"model": "sim", "messages": messages})
    err = error_of(r, 422)
    with pytest.raises(ValidationError) as pydantics:
        ChatCompletionRequest.model_validate({"model": "sim", "messages": messages})
    assert (
        err["param"] == "messages"
        and err["message"] == f"messages: {pydantics.value.errors()[0]['msg']}"
    )
    assert str(MAX_CHAT_MESSAGES) in err["message"] and not parsed
    # under the limit, the body goes on to FastAPI's parse as any other
    r = await stack.client.post(
        "/v1/chat/completions", json={"model": "sim", "messages": messages[:2]}
    )
    assert r.status_code == 200 and parsed


@pytest.mark.parametrize(
    ("path", "field", "shape"),
    [
        ("/v1/jobs", "input_ids", "ids"),
        ("/v1/completions", "prompt", "ids"),
        ("/v1/completions", "prompt", "prompts"),
    ],
)
async def test_a_prompt_of_ids_with_no_room_is_refused_before_the_body_is_parsed(
    stack: Stack, parsed: list[int], path: str, field: str, shape: str
) -> None:
    """Its length comes from a raw scan against the model's context (5,000,000 ids: seconds of
    parsing and checking each id before); the 400 is the job's own check's."""
    context = SimEngine().card.max_seq_len
    ids = [300 + i % 100 for i in range(context)]
    prompt: object = ids if shape == "ids" else [[5, 6], ids, [7]]
    body = {"model": "sim", field: prompt, "max_tokens": 1}
    err = error_of(await stack.client.post(path, json=body), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert err["message"] == (
        f"prompt is {context} tokens, the model's maximum context length is {context} tokens: "
        "no room is left to generate"
    )
    assert not parsed
    # with room left, the body goes on to the full parse and the job runs
    body[field] = ids[:8] if shape == "ids" else [[5, 6], ids[:8]]
    r = await stack.client.post(path, json=body)
    assert r.status_code in (200, 202), r.text
    assert parsed


# ---- ids, limits and messages as OpenAI answers them ----------------------------------------


async def test_a_malformed_id_is_the_same_404_as_an_unknown_one(stack: Stack) -> None:
    """A malformed id names nothing, as an unknown one: the same 404 (the SDK's
    NotFoundError), not a 422 quoting the id's pattern."""
    unknown = {"batch": "batch_" + "0" * 32, "file": "file-" + "0" * 32, "job": "0" * 32}
    routes = {
        "batch": ("/v1/batches/{}", "/v1/batches/{}/cancel"),
        "file": ("/v1/files/{}", "/v1/files/{}/content"),
        "job": ("/v1/jobs/{}", "/v1/jobs/{}/events"),
    }
    for kind, templates in routes.items():
        for template in templates:
            method = "POST" if template.endswith("cancel") else "GET"
            known_shape = await stack.client.request(method, template.format(unknown[kind]))
            expected = error_of(known_shape, 404)
            for bad in (f"{kind}_nope", "x" * 80):
                err = error_of(await stack.client.request(method, template.format(bad)), 404)
                shown_id = repr(bad[:64])[1:-1] + ("…" if len(bad) > 64 else "")
                assert err == {
                    **expected,
                    "message": expected["message"].replace(unknown[kind], shown_id),
                }, template


async def test_an_over_large_body_is_an_invalid_request_error(small: Stack) -> None:
    big = json.dumps({"model": "sim", "prompt": "x" * (2 * BODY_LIMIT)})
    err = error_of(await small.client.post("/v1/jobs", content=big, headers=JSON), 413)
    assert err["type"] == "invalid_request_error"


async def test_nan_and_a_bad_completion_window_are_refused_in_words(stack: Stack) -> None:
    for value in ("NaN", "Infinity"):
        raw = '{"model": "sim", "prompt": "x", "temperature": ' + value + "}"
        for route in ("/v1/jobs", "/v1/completions"):
            err = error_of(await stack.client.post(route, content=raw, headers=JSON), 422)
            assert err["param"] == "temperature"
            assert "finite number" in err["message"] and "less than" not in err["message"]
    raw = '{"model": NaN, "prompt": "x"}'  # not a number field: the usual type error
    err = error_of(await stack.client.post("/v1/jobs", content=raw, headers=JSON), 422)
    assert err["param"] == "model" and "finite" not in err["message"]
    body = {"input_file_id": "file-" + "0" * 32, "endpoint": "/v1/completions"}
    for window in ("48h", "1d", "soon"):
        r = await stack.client.post("/v1/batches", json={**body, "completion_window": window})
        err = error_of(r, 422)
        assert err["param"] == "completion_window" and "(?:" not in err["message"]
        assert "at most 24h" in err["message"] and repr(window) in err["message"]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "wizard", "content": "x"}, "messages.0.role"),
        ({"role": "user"}, "messages.0.content"),
        ({"role": "system", "content": None}, "messages.0.content"),
        ({"role": "assistant"}, "messages.0.content"),
        ({"role": "tool", "content": "42"}, "messages.0.tool_call_id"),
    ],
)
async def test_chat_messages_are_checked_as_openai_checks_them(
    stack: Stack, message: dict, param: str
) -> None:
    body = {"model": "sim", "messages": [message], "max_tokens": 2}
    err = error_of(await stack.client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param.endswith("role"):
        assert "'user'" in err["message"] and "'assistant'" in err["message"]


async def test_an_assistant_message_calling_tools_needs_no_content(stack: Stack) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    r = await stack.client.post(
        "/v1/chat/completions", json={"model": "sim", "messages": messages, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
