"""Constraints on the native job API: checked by the gateway before the job exists, kept in
the record, applied by the (sim) worker: every output fits. A constraint that cannot run is a
400 naming the field and the reason, or, where only the worker can find out, a job failed at
once with `constraint_failed` (never an empty success, never another attempt)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest
import redis.asyncio as aioredis

from shared.settings import Settings
from tests.conftest import Stack, parse_sse, running_stack
from worker.constraint import allows
from worker.sim import SimEngine

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
        (
            {"json_schema": {"type": "object"}, "regex": "a"},
            "regex",
            "give one constraint at most: json_schema and regex were both given",
        ),
        ({"regex": "([a-z"}, "regex", "unclosed character class at column 2 (`[a-z`)"),
        ({"regex": "ab{2,1}"}, "regex", "the start must be <= the end at column 3 (`{2,1}`)"),
        ({"grammar": 'start: "a" b\nb: /x[/'}, "grammar", "line 2, column 4: invalid regex"),
        (
            {"json_schema": {"properties": {"code": {"type": "string", "pattern": "^[A-Z]{2"}}}},
            "json_schema.properties.code.pattern",
            "this regex cannot be used: ",
        ),
        (
            {"json_schema": {"items": {"patternProperties": {"(x": {"type": "integer"}}}}},
            "json_schema.items.patternProperties.(x",
            "unclosed group at column 1 (`(x`)",
        ),
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
    assert err["param"] == param and err["message"].startswith(param), err
    assert "1(8)" not in err["message"] and "Value error" not in err["message"]


UNRUNNABLE = "a{1000}{1000}"
"""A regex whose matcher builds, but whose lexer gives up (over llguidance's limits) at the
first `a`: the gateway walks the first steps of every constraint and finds it."""


async def test_a_regex_that_cannot_run_is_a_400_on_completions_never_an_empty_200(
    stack: Stack,
) -> None:
    body = {"model": "sim", "prompt": "hi", "max_tokens": 20, "regex": UNRUNNABLE}
    r = await stack.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (
        "regex",
        "invalid_constraint",
        "invalid_request_error",
    )
    assert (
        "gives up on the first tokens of output (lexer error: too many expressions"
        in err["message"]
    )


async def test_two_constraints_on_completions_name_the_fields(stack: Stack) -> None:
    body = {"model": "sim", "prompt": "hi", "regex": "a", "json_schema": {"type": "object"}}
    r = await stack.client.post("/v1/completions", json=body)
    assert 400 <= r.status_code < 500
    err = r.json()["error"]
    assert err["param"] == "regex"
    assert err["message"].endswith(
        "give one constraint at most: json_schema and regex were both given"
    )


# ---- what only the worker can find out ---------------------------------------------------

DERAIL = "derail"
FAULT_AT = 3
WORDS = "[a-z ]{40,60}"
"""No FAULT_AT tokens of the sim (words of at most 10 characters) complete it."""


class DerailingSim(SimEngine):
    """The sim, but a constrained job with DERAIL in its prompt takes, after FAULT_AT tokens,
    one its grammar refuses: its (real) matcher fails there, as one does where a limit is met
    only as the output grows, which no check before the job can see."""

    def _constrained_choice(self, s: Any, row: memoryview, x: int, long: bool) -> int | None:
        if s.position == FAULT_AT and DERAIL in self._tokenizer.decode(s.job.input_ids):
            return next(t for t in sorted(self._plain) if not allows(row, t))
        return super()._constrained_choice(s, row, x, long)


@pytest.fixture
async def derailing(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[Stack]:
    async with running_stack(settings, redis, DerailingSim) as s:
        yield s


def attempt_failures(stack: Stack) -> float:
    """The worker's `genq_attempt_failures` (attempts it failed and handed back)."""
    samples = [s for m in stack.worker.st.metrics.registry.collect() for s in m.samples]
    return sum(s.value for s in samples if s.name == "genq_attempt_failures_total")


async def test_a_constraint_failing_on_the_worker_fails_the_job_at_once(derailing: Stack) -> None:
    """Its first attempt ends it `failed` with `constraint_failed`, naming the field; no
    second attempt, nothing counted against the worker, no dead letter."""
    job = await derailing.submit(prompt=f"{DERAIL} me", max_tokens=40, regex=WORDS, seed=1)
    done = await derailing.wait_status(job["id"], "failed", "succeeded")
    assert done["status"] == "failed" and done["attempt"] == 1, done
    error = done["error"]
    assert error["code"] == "constraint_failed" and error["message"].startswith("regex: ")
    assert f"after {FAULT_AT} generated tokens" in error["message"]
    assert done["usage"]["completion_tokens"] == FAULT_AT  # what it generated is kept
    r = await derailing.client.get(f"/v1/jobs/{job['id']}/events")
    events = parse_sse(r.text)
    assert [t for _, t, _ in events].count("started") == 1
    assert events[-1][1] == "error" and events[-1][2]["code"] == "constraint_failed"
    assert attempt_failures(derailing) == 0
    assert derailing.worker.st.runner.failures == 0
    assert await derailing.redis.xlen(derailing.worker.st.keys.dead_letters()) == 0
    ok = await derailing.submit(prompt="fine", max_tokens=40, regex=WORDS)
    assert (await derailing.wait_status(ok["id"], "succeeded"))["attempt"] == 1


async def test_a_constraint_failing_on_the_worker_is_an_invalid_request_on_openai(
    derailing: Stack,
) -> None:
    """Not streamed: a 400 `invalid_request_error` naming the field. Streamed (200 already
    sent): an error object of that type in the stream, then `[DONE]`."""
    client = derailing.client
    body = {"model": "sim", "prompt": f"{DERAIL} me", "max_tokens": 40, "regex": WORDS, "seed": 1}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error",
        "regex",
        "constraint_failed",
    )
    r = await client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200
    frames = [f.removeprefix("data: ") for f in r.text.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    err = json.loads(frames[-2])["error"]
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error",
        "regex",
        "constraint_failed",
    )
    long = {"type": "string", "minLength": 40}  # not complete at FAULT_AT tokens
    schema = {"type": "object", "properties": {"s": long}, "required": ["s"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    chat = {
        "model": "sim",
        "messages": [{"role": "user", "content": DERAIL}],
        "max_tokens": 40,
        "seed": 1,
        "response_format": fmt,
    }
    r = await client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("response_format", "constraint_failed")
    assert err["message"].startswith("response_format: the constraint failed")
