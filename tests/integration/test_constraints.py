"""Constraints on the native job API: checked by the gateway before the job exists, kept in
the record, applied by the (sim) worker: every output fits."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from tests.conftest import Stack

pytestmark = pytest.mark.parametrize("redis", ["redis"], indirect=True)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"kind": {"enum": ["cat", "dog"]}},
                    "required": ["kind"],
                    "additionalProperties": False,
                },
            ]
        },
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}


async def test_json_schema_outputs_validate_and_the_record_keeps_the_schema(stack: Stack) -> None:
    jobs = [
        await stack.submit(prompt=f"person {i}", max_tokens=200, json_schema=PERSON, seed=i)
        for i in range(8)
    ]
    for job in jobs:
        done = await stack.wait_status(job["id"], "succeeded")
        assert done["finish_reason"] == "stop", done
        jsonschema.validate(json.loads(done["text"]), PERSON)
        assert done["constraint"] == {
            "type": "json_schema",
            "json_schema": PERSON,
            "strict": True,
            "unenforced": [],
        }
        assert done["schema_check"] == {"valid": True, "errors": []}


NOT_FIVE = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 5, "not": {"const": 5}}},
    "required": ["n"],
}
"""The grammar enforces n = 5; `not` (left to the check) refuses it: every output is invalid."""


async def test_json_schema_strict_false_runs_what_strict_refuses(stack: Stack) -> None:
    refused = await stack.client.post(
        "/v1/jobs", json={"model": "sim", "prompt": "p", "json_schema": NOT_FIVE}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == (
        "json_schema.properties.n.not"
    )
    job = await stack.submit(
        prompt="p", max_tokens=20, json_schema=NOT_FIVE, json_schema_strict=False
    )
    done = await stack.wait_status(job["id"], "succeeded")
    assert json.loads(done["text"]) == {"n": 5}
    assert done["constraint"]["strict"] is False
    assert done["constraint"]["unenforced"] == ["json_schema.properties.n.not"]
    assert done["schema_check"]["valid"] is False
    alone = await stack.client.post(
        "/v1/jobs", json={"model": "sim", "prompt": "p", "json_schema_strict": False}
    )
    assert 400 <= alone.status_code < 500 and "json_schema_strict" in alone.text


async def test_regex_and_grammar_outputs_match(stack: Stack) -> None:
    pattern = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"
    a = await stack.submit(prompt="an email", max_tokens=60, regex=pattern)
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,3}/ | "x"'
    b = await stack.submit(prompt="a tuple", max_tokens=60, grammar=lark)
    a_done = await stack.wait_status(a["id"], "succeeded")
    assert re.fullmatch(pattern, a_done["text"]), a_done["text"]
    b_done = await stack.wait_status(b["id"], "succeeded")
    assert re.fullmatch(r"\((?:[0-9]{1,3}|x)(?:,(?:[0-9]{1,3}|x))*\)", b_done["text"])
    assert b_done["constraint"] == {"type": "grammar", "grammar": lark}


def _deep_schema(levels: int) -> str:
    """A schema nested `levels` objects deep, as JSON text (json.dumps would recurse)."""
    return '{"type":"object","properties":{"a":' * levels + "{}" + "}}" * levels


async def test_hostile_constraints_are_4xx_and_leave_the_worker_as_fast(stack: Stack) -> None:
    """A schema 10,000 levels deep, a 1 MB enum, a $ref loop, an invalid regex, a grammar with
    no finite string: each a 4xx in genq's error shape; an ordinary job submitted after them
    runs as fast as one before them."""
    before = await stack.submit(prompt="before", max_tokens=20)
    t0 = time.monotonic()
    await stack.wait_status(before["id"], "succeeded")
    ordinary_s = time.monotonic() - t0
    deep = '{"model":"sim","prompt":"p","json_schema":' + _deep_schema(10_000) + "}"
    enum = {"enum": [f"value-{i:08d}" for i in range(80_000)]}  # ~1.1 MB
    hostile = [
        ("content", deep, "body"),
        ("json", {"json_schema": enum}, "json_schema"),
        ("json", {"json_schema": {"$ref": "#"}}, "json_schema"),
        ("json", {"regex": "[a-"}, "regex"),
        ("json", {"grammar": 'start: "a" start'}, "grammar"),
        ("json", {"json_schema": json.loads(_deep_schema(65))}, "json_schema"),
    ]
    for how, body, param in hostile:
        if how == "content":
            r = await stack.client.post(
                "/v1/jobs", content=body, headers={"content-type": "application/json"}
            )
        else:
            r = await stack.client.post("/v1/jobs", json={"model": "sim", "prompt": "p", **body})
        assert 400 <= r.status_code < 500, (param, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
    after = await stack.submit(prompt="after", max_tokens=20)
    t0 = time.monotonic()
    await stack.wait_status(after["id"], "succeeded")
    assert time.monotonic() - t0 < max(1.0, 5 * ordinary_s)


async def test_max_tokens_cuts_a_constrained_output_short(stack: Stack) -> None:
    job = await stack.submit(prompt="cut", max_tokens=3, json_schema=PERSON)
    done = await stack.wait_status(job["id"], "succeeded")
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 3
    assert done["text"].startswith('{"')


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"regex": "(ab"}, "regex", "regex"),
        ({"grammar": 'start: a\na: "x" a'}, "grammar", "never end"),
        ({"grammar": "start: nosuchrule"}, "grammar", "grammar"),
        ({"regex": "a[^\\x00-\\U0010FFFF]"}, "regex", "admits no output"),
        ({"json_schema": {"type": "object"}, "regex": "a"}, "body", "one constraint"),
        ({"regex": "a+", "banned_strings": ["aa"]}, "banned_strings", "constraint"),
        ({"regex": "a+", "min_tokens": 3, "max_tokens": 5}, "min_tokens", "constraint"),
        (
            {"json_schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
            "json_schema",
            "cannot be used",
        ),
    ],
)
async def test_a_constraint_that_cannot_run_is_a_400_naming_the_field(
    stack: Stack, body: dict, param: str, needle: str
) -> None:
    r = await stack.client.post("/v1/jobs", json={"model": "sim", "prompt": "p", **body})
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    if param != "body":
        assert err["param"] == param
