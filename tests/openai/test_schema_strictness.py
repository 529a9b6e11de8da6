"""JSON schemas with keywords the grammar cannot enforce (`uniqueItems`), through the openai
SDK: `strict: true` is a 400 naming the keyword's path; `strict: false` (and no `strict`,
OpenAI's default) answers, names the keyword in `genq-schema-unenforced` and the job record,
and reports whether the finished output is valid under the whole schema: the header, each
choice's `genq_schema` (streamed: in its last chunk) and the record's `schema_check`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.openai.conftest import API_KEY, CHAT, TOOLS, GenqServer

ASK = [{"role": "user", "content": "Tag it."}]
AT_MOST_ONE = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 1, "uniqueItems": True}
    },
    "required": ["tags"],
    "additionalProperties": False,
}
"""`uniqueItems` left to the check: one tag at most cannot repeat, so every output is valid."""
REPEATS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"const": "a"}, "minItems": 2, "uniqueItems": True}
    },
    "required": ["tags"],
    "additionalProperties": False,
}
"""What the grammar enforces (two `"a"`s or more) always breaks `uniqueItems`."""
TAGS_PATH = "response_format.json_schema.schema.properties.tags.uniqueItems"


def fmt(schema: dict[str, Any], strict: bool | None) -> Any:
    spec: dict[str, Any] = {"name": "tags", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def record(server: GenqServer, completion_id: str) -> dict[str, Any]:
    job_id = completion_id.removeprefix("chatcmpl-")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=headers).json()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("schema", "param"),
    [
        (REPEATS, TAGS_PATH),
        (
            {
                "$defs": {"T": REPEATS["properties"]["tags"]},
                "properties": {"t": {"$ref": "#/$defs/T"}},
            },  # type: ignore[index]
            "response_format.json_schema.schema.$defs.T.uniqueItems",
        ),
    ],
)
def test_strict_refuses_what_it_cannot_enforce_naming_where(
    client: openai.OpenAI, schema: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=CHAT, messages=ASK, response_format=fmt(schema, True), max_tokens=50
        )  # type: ignore[call-overload]
    assert e.value.param == param
    assert param in e.value.message and "strict: false" in e.value.message


@pytest.mark.parametrize("strict", [False, None], ids=["strict false", "no strict"])
def test_lenient_answers_and_says_what_it_did_not_enforce(
    client: openai.OpenAI, server: GenqServer, strict: bool | None
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT, messages=ASK, response_format=fmt(AT_MOST_ONE, strict), max_tokens=80
    )  # type: ignore[call-overload]
    r = raw.parse()
    [choice] = r.choices
    jsonschema.validate(json.loads(choice.message.content or ""), AT_MOST_ONE)
    assert raw.headers["genq-schema-unenforced"] == "uniqueItems"
    assert raw.headers["genq-schema-valid"] == "true"
    assert (choice.model_extra or {})["genq_schema"] == {"valid": True, "errors": []}
    job = record(server, r.id)
    assert job["constraint"]["strict"] is False
    assert job["constraint"]["unenforced"] == [TAGS_PATH]
    assert job["schema_check"] == {"valid": True, "errors": []}


def test_an_output_the_grammar_let_through_is_reported_invalid(
    client: openai.OpenAI, server: GenqServer
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT, messages=ASK, response_format=fmt(REPEATS, False), max_tokens=80, n=2
    )  # type: ignore[call-overload]
    r = raw.parse()
    for choice in r.choices:
        tags = json.loads(choice.message.content or "")["tags"]
        assert len(tags) >= 2 and set(tags) == {"a"}  # the grammar held, uniqueItems did not
        check = (choice.model_extra or {})["genq_schema"]
        assert check["valid"] is False and "non-unique" in check["errors"][0]
    assert raw.headers["genq-schema-valid"] == "false,false"
    assert record(server, r.id)["schema_check"]["valid"] is False
    stream = client.chat.completions.create(
        model=CHAT, messages=ASK, response_format=fmt(REPEATS, False), max_tokens=80, stream=True
    )  # type: ignore[call-overload]
    last = [c for c in stream if c.choices][-1].choices[0]
    assert last.finish_reason == "stop"
    assert (last.model_extra or {})["genq_schema"]["valid"] is False


def test_a_function_tool_is_strict_or_not_by_its_own_flag(client: openai.OpenAI) -> None:
    params = AT_MOST_ONE

    def lookup(strict: bool) -> Any:
        fn = {"name": "lookup", "parameters": params, **({"strict": True} if strict else {})}
        return [{"type": "function", "function": fn}]

    args: Any = {"model": TOOLS, "messages": ASK, "tool_choice": "required", "max_tokens": 80}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args, tools=lookup(True))
    assert e.value.param == "tools.0.function.parameters.properties.tags.uniqueItems"
    raw = client.chat.completions.with_raw_response.create(**args, tools=lookup(False))
    [call] = raw.parse().choices[0].message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), params)
    assert raw.headers["genq-schema-unenforced"] == "uniqueItems"


def test_responses_text_format_is_named_in_its_own_terms(client: openai.OpenAI) -> None:
    def text(strict: bool) -> Any:
        return {"format": {"type": "json_schema", "name": "t", "schema": REPEATS, "strict": strict}}

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=CHAT, input="Tag it.", text=text(True))
    assert e.value.param == "text.format.schema.properties.tags.uniqueItems"
    raw = client.responses.with_raw_response.create(model=CHAT, input="Tag it.", text=text(False))
    assert raw.headers["genq-schema-unenforced"] == "uniqueItems"
    assert raw.headers["genq-schema-valid"] == "false"
    assert (raw.parse().model_extra or {})["genq_schema"]["valid"] is False
