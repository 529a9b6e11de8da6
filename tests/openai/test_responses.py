"""The Responses API through the official openai SDK, unchanged: plain, streamed, background
then polled, background then streamed from `starting_after`, cancelled, deleted; a
conversation carried on by `previous_response_id`; `text.format` and function tools (one
implementation with chat); bad input answered 4xx naming the field."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import redis

from tests.conftest import REDIS_URL
from tests.openai.conftest import API_KEY, CHAT, OTHER_KEY, SLOW, TOOLS, GenqServer, job_spec
from tests.procs import Cluster

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _wait_status(client: openai.OpenAI, rid: str, within: float = 15.0) -> object:
    deadline = time.monotonic() + within
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.02)


def test_a_plain_response_reads_back_the_same(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=CHAT, input="Say something", instructions="Be brief", max_output_tokens=12
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.instructions == "Be brief" and r.max_output_tokens == 12
    assert r.usage is not None and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.status == r.status
    assert again.usage == r.usage


def test_input_items_become_the_conversation(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=CHAT,
        input=[
            {"role": "developer", "content": "You answer tersely."},
            {"role": "user", "content": [{"type": "input_text", "text": "first question"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "first answer"}]},
            {"role": "user", "content": "second question"},
        ],
        max_output_tokens=4,
    )
    assert r.status in ("completed", "incomplete")  # four messages in the prompt, not one:
    one = client.responses.create(model=CHAT, input="second question", max_output_tokens=4)
    assert r.usage is not None and one.usage is not None
    assert r.usage.input_tokens > one.usage.input_tokens + 6


def test_a_streamed_response_has_openais_events_in_order(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=CHAT, input="Stream it", max_output_tokens=10, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == ORDER
    assert kinds[-4:-1] == CLOSING and kinds[-1] in ("response.completed", "response.incomplete")
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))  # strictly increasing
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas and final.output_text == deltas
    assert events[-4].text == deltas
    assert client.responses.retrieve(final.id).output_text == deltas


def test_background_then_polled(client: openai.OpenAI) -> None:
    r = client.responses.create(model=CHAT, input="later", max_output_tokens=8, background=True)
    assert r.status == "queued" and r.background is True and r.output == []
    done = _wait_status(client, r.id)
    assert done.status in ("completed", "incomplete") and done.output_text  # type: ignore[attr-defined]


def test_background_then_streamed_from_any_sequence_number(
    client: openai.OpenAI, server: GenqServer
) -> None:
    r = client.responses.create(model=SLOW, input="long", max_output_tokens=12, background=True)
    with client.responses.retrieve(r.id, stream=True) as stream:
        whole = [e.model_dump(mode="json") for e in stream]
    assert [e["type"] for e in whole[:4]] == ORDER
    assert whole[-1]["type"] in ("response.completed", "response.incomplete")
    for cut in (0, 3, len(whole) // 2, whole[-2]["sequence_number"]):
        after = whole[[e["sequence_number"] for e in whole].index(cut) + 1 :] if cut else whole[1:]
        with client.responses.retrieve(r.id, stream=True, starting_after=cut) as stream:
            again = [e.model_dump(mode="json") for e in stream]
        # the same events, numbers and text, on a replay from any point
        assert [(e["type"], e["sequence_number"], e.get("delta")) for e in again] == [
            (e["type"], e["sequence_number"], e.get("delta")) for e in after
        ]


def test_another_gateway_process_streams_it_on(
    client: openai.OpenAI, server: GenqServer, tmp_path: Path
) -> None:
    """A background response followed through one gateway, then through another process from
    where the first left off: the same events, no gap, no repeat."""
    r = client.responses.create(model=SLOW, input="long", max_output_tokens=20, background=True)
    seen = []
    with client.responses.retrieve(r.id, stream=True) as stream:
        for e in stream:
            seen.append(e)
            if e.type == "response.output_text.delta" and len(seen) >= 6:
                break  # this client goes; the response runs on
    cluster = Cluster(REDIS_URL, tmp_path, server.settings.key_prefix)
    try:
        other = cluster.gateway(GENQ_API_KEYS=f"{API_KEY},{OTHER_KEY}")
        with openai.OpenAI(base_url=f"{other.url}/v1", api_key=API_KEY, max_retries=0) as c:
            cut = seen[-1].sequence_number
            with c.responses.retrieve(r.id, stream=True, starting_after=cut) as stream:
                rest = list(stream)
    finally:
        cluster.close()
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == sorted(set(numbers)) and rest[0].sequence_number > cut
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert rest[-1].type in ("response.completed", "response.incomplete")
    assert rest[-1].response.output_text == text


def test_a_background_response_cancelled(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=SLOW, input="forever", max_output_tokens=4000, background=True
    )
    deadline = time.monotonic() + 10
    while client.responses.retrieve(r.id).status == "queued" and time.monotonic() < deadline:
        time.sleep(0.02)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status in ("cancelled", "in_progress")
    assert _wait_status(client, r.id).status == "cancelled"  # type: ignore[attr-defined]


def test_a_conversation_over_three_turns(client: openai.OpenAI) -> None:
    first = client.responses.create(model=CHAT, input="turn one", max_output_tokens=6)
    second = client.responses.create(
        model=CHAT, input="turn two", previous_response_id=first.id, max_output_tokens=6
    )
    third = client.responses.create(
        model=CHAT, input="turn three", previous_response_id=second.id, max_output_tokens=6
    )
    alone = client.responses.create(model=CHAT, input="turn three", max_output_tokens=6)
    assert third.previous_response_id == second.id
    used = [r.usage.input_tokens for r in (alone, first, second, third)]  # type: ignore[union-attr]
    # each turn carries every earlier input and answer
    assert used[3] > used[2] > used[1] and used[3] > used[0] + 2 * 6
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=CHAT, input="x", previous_response_id="resp_" + "0" * 32, max_output_tokens=2
        )


def test_another_keys_response_is_a_404(client: openai.OpenAI, server: GenqServer) -> None:
    r = client.responses.create(model=CHAT, input="mine", max_output_tokens=2)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(
                model=CHAT, input="x", previous_response_id=r.id, max_output_tokens=2
            )
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(r.id)
    client.responses.retrieve(r.id)  # still there for its owner


def test_deleted_and_unstored_responses_are_gone(client: openai.OpenAI) -> None:
    r = client.responses.create(model=CHAT, input="forget me", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=CHAT, input="x", max_output_tokens=2, store=False)
    assert unstored.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_json_schema_format_and_a_function_tool(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=CHAT,
        input="The weather as JSON",
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        max_output_tokens=200,
    )
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    called = client.responses.create(
        model=TOOLS, input="Weather?", tools=tools, tool_choice="required", max_output_tokens=200
    )
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    # the tool's answer goes back as a function_call_output; the model answers on
    follow = client.responses.create(
        model=TOOLS,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=tools,
        max_output_tokens=20,
    )
    assert follow.status in ("completed", "incomplete")
    streamed = list(
        client.responses.create(
            model=TOOLS,
            input="Weather?",
            tools=tools,
            tool_choice="required",
            max_output_tokens=200,
            stream=True,
        )
    )
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert any(i.type == "function_call" for i in done)
    args = [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"]
    for a in args:
        jsonschema.validate(json.loads(a), WEATHER)


@pytest.mark.parametrize(
    ("body", "status", "where"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            422,
            ["input", 0, "content", 0, "type"],
        ),
        ({"input": [{"type": "web_search_call"}]}, 422, ["input", 0, "type"]),
        ({"input": []}, 422, ["input"]),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 422, ["metadata"]),
        ({"input": "x", "background": True, "store": False}, 400, "store"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    server: GenqServer, body: dict, status: int, where: str | list
) -> None:
    r = httpx.post(
        f"{server.url}/v1/responses",
        json={"model": CHAT, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == where
    else:  # every way the item fails is listed; the one that names what is wrong among them
        assert where in [d["loc"] for d in r.json()["detail"]]


def test_a_response_is_a_job_too(
    client: openai.OpenAI, db: redis.Redis, server: GenqServer
) -> None:
    r = client.responses.create(model=CHAT, input="as a job", max_output_tokens=3)
    job_id = r.id.removeprefix("resp_")
    spec = job_spec(db, server.keys, job_id)
    assert spec.id == job_id
    view = httpx.get(
        f"{server.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()
    assert view["metadata"]["api"] == "openai.response" and view["text"] == r.output_text


def test_an_idempotency_key_gives_the_same_response(client: openai.OpenAI) -> None:
    key = {"Idempotency-Key": f"resp-test-{time.time_ns()}"}
    first = client.responses.create(
        model=CHAT, input="once", max_output_tokens=5, background=True, extra_headers=key
    )
    again = client.responses.create(
        model=CHAT, input="once", max_output_tokens=5, background=True, extra_headers=key
    )
    assert again.id == first.id
    with pytest.raises(openai.UnprocessableEntityError):  # the key with another body
        client.responses.create(
            model=CHAT, input="twice", max_output_tokens=5, background=True, extra_headers=key
        )
    done = _wait_status(client, first.id)
    assert done.status in ("completed", "incomplete")  # type: ignore[attr-defined]


def test_a_deadline_passed_fails_the_response(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=SLOW,
        input="late",
        max_output_tokens=4000,
        background=True,
        extra_body={"timeout_s": 0.2},
    )
    done = _wait_status(client, r.id)
    assert done.status == "failed" and done.error is not None  # type: ignore[attr-defined]
    assert done.error.code == "deadline_exceeded"  # type: ignore[attr-defined]
