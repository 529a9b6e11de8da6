"""Structured outputs through the official openai SDK, unchanged: `response_format` (a
pydantic model with `chat.completions.parse`, `json_object`, a strict schema with nested
objects, arrays, enums and anyOf), streamed and not. Every reply validates."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.openai.conftest import API_KEY, CHAT, TOOLS, GenqServer

ASK = [{"role": "user", "content": "Describe a person."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]
    pet: Pet | None


STRICT = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "population": {"type": "integer"},
        "districts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "kind": {"enum": ["north", "south", "old town"]},
                },
                "required": ["name", "kind"],
                "additionalProperties": False,
            },
        },
        "mayor": {"anyOf": [{"type": "null"}, {"type": "string"}]},
    },
    "required": ["city", "population", "districts", "mayor"],
    "additionalProperties": False,
}

UNRUNNABLE = {
    "type": "object",
    "properties": {"s": {"type": "string", "pattern": "^a{1000}{1000}$"}},
    "required": ["s"],
}
"""A schema whose `pattern`'s lexer gives up (over llguidance's limits) at the first `a`."""


@pytest.mark.parametrize("seed", range(3))
def test_parse_with_a_pydantic_model(client: openai.OpenAI, seed: int) -> None:
    r = client.chat.completions.parse(
        model=CHAT,
        messages=ASK,
        response_format=Person,
        max_tokens=300,
        seed=seed,  # type: ignore[arg-type]
    )
    [choice] = r.choices
    assert choice.finish_reason == "stop"
    person = choice.message.parsed
    assert isinstance(person, Person)
    assert Person.model_validate_json(choice.message.content or "") == person


def test_json_object_and_a_strict_schema_streamed_and_not(
    client: openai.OpenAI, server: GenqServer
) -> None:
    r = client.chat.completions.create(
        model=CHAT,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=200,  # type: ignore[arg-type]
    )
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": STRICT, "strict": True}}
    whole = client.chat.completions.create(
        model=CHAT,
        messages=ASK,
        response_format=fmt,
        max_tokens=400,
        seed=5,  # type: ignore[arg-type]
    )
    jsonschema.validate(json.loads(whole.choices[0].message.content or ""), STRICT)
    pieces = client.chat.completions.create(
        model=CHAT,
        messages=ASK,
        response_format=fmt,
        max_tokens=400,
        seed=5,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content
    job = httpx.get(
        f"{server.url}/v1/jobs/{whole.id.removeprefix('chatcmpl-')}",
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert job["constraint"] == {
        "type": "json_schema",
        "json_schema": STRICT,
        "origin": "response_format",
        "strict": True,
        "unenforced": [],
    }
    assert job["schema_check"] == {"valid": True, "errors": []}


NATIVE_PATTERN = "(yes|no)-[0-9]{3}"


def test_native_constraint_fields_are_served_on_chat_and_responses(client: openai.OpenAI) -> None:
    """`regex`, `grammar` and `json_schema` (genq's own fields, sent in `extra_body`) hold a
    chat reply and a response as they hold a completion, streamed and not."""
    extra = {"regex": NATIVE_PATTERN}
    whole = client.chat.completions.create(
        model=CHAT, messages=ASK, max_tokens=30, seed=2, extra_body=extra
    )
    assert re.fullmatch(NATIVE_PATTERN, whole.choices[0].message.content or "")
    pieces = client.chat.completions.create(
        model=CHAT, messages=ASK, max_tokens=30, seed=2, extra_body=extra, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content
    schema = client.chat.completions.create(
        model=CHAT, messages=ASK, max_tokens=400, seed=5, extra_body={"json_schema": STRICT}
    )
    jsonschema.validate(json.loads(schema.choices[0].message.content or ""), STRICT)
    lark = client.chat.completions.create(
        model=CHAT, messages=ASK, max_tokens=30, extra_body={"grammar": 'start: "up" | "down"'}
    )
    assert lark.choices[0].message.content in ("up", "down")
    response = client.responses.create(
        model=CHAT, input="Hi", max_output_tokens=30, extra_body=extra
    )
    assert re.fullmatch(NATIVE_PATTERN, response.output_text)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"response_format": {"type": "json_object"}}, "regex and response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "regex and tools"),
        ({"extra_body": {"regex": "a", "grammar": 'start: "a"'}}, "regex and grammar"),
    ],
)
def test_a_native_constraint_with_another_is_a_400_naming_both(
    client: openai.OpenAI, kwargs: dict, named: str
) -> None:
    kwargs.setdefault("extra_body", {"regex": NATIVE_PATTERN})
    model = TOOLS if "tools" in kwargs else CHAT
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, **kwargs)
    param = named.split(" and ")[-1] if "grammar" in named else "regex"  # genq's own, last
    assert e.value.body["param"] == param and named in e.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=CHAT,
            input="Hi",
            text={"format": {"type": "json_object"}},
            extra_body={"regex": NATIVE_PATTERN},
        )
    assert "regex and text.format" in e.value.message


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": UNRUNNABLE}},
            "response_format.json_schema.schema.properties.s.pattern",
        ),
    ],
)
def test_a_response_format_that_cannot_run_is_a_400_naming_the_field(
    client: openai.OpenAI, fmt: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=CHAT, messages=ASK, response_format=fmt)  # type: ignore[arg-type]
    assert e.value.body["param"] == param  # type: ignore[index]
    assert e.value.body["message"].startswith(param)  # type: ignore[index]
