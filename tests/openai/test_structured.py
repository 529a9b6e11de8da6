"""Structured outputs through the official openai SDK, unchanged: `response_format` (a
pydantic model with `chat.completions.parse`, `json_object`, a strict schema with nested
objects, arrays, enums and anyOf), streamed and not. Every reply validates."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.openai.conftest import API_KEY, CHAT, GenqServer

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
    ],
)
def test_a_response_format_that_cannot_run_is_a_400_naming_the_field(
    client: openai.OpenAI, fmt: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=CHAT, messages=ASK, response_format=fmt)  # type: ignore[arg-type]
    assert e.value.body["param"] == param  # type: ignore[index]
