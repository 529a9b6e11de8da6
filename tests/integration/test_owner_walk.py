"""Everything a key can reach is its owner's, on every route: the OpenAPI document is walked,
and every operation that takes an id (in its path, its query or its JSON body) is called by
key A with ids of things key B made (a job, a batch's jobs, an uploaded file, a batch and its
output and error files). Each answer must equal the answer for a well-formed id that does not
exist, no listing of A's shows B's ids, and B's things are unchanged afterwards.

An operation the document gains that takes an id fails the test until the table below says
which of B's things it takes (or why it takes none of theirs): no new route is missed."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from shared.batches import batch_job_id
from shared.keys import Keys
from shared.settings import Settings
from tests.conftest import Stack, running_stack

A, B = "key-a-0123", "key-b-4567"
POISON = "poison-pill"
"""A prompt holding this fails (the sim engine's fault injection): the batch's error file."""
WAIT_S = 20.0
POLL_S = 0.02

JOBS = ("job", "batch_job")
FILES = ("input_file", "output_file", "error_file")
NO_OWNED_ID: tuple[str, ...] = ()

COVERED: dict[tuple[str, str, str], tuple[str, ...]] = {
    # (method, path template, parameter): the kinds of B's things the parameter names
    ("GET", "/v1/jobs/{job_id}", "job_id"): JOBS,
    ("DELETE", "/v1/jobs/{job_id}", "job_id"): JOBS,
    ("GET", "/v1/jobs/{job_id}/events", "job_id"): JOBS,
    ("GET", "/v1/files/{file_id}", "file_id"): FILES,
    ("GET", "/v1/files/{file_id}/content", "file_id"): FILES,
    ("DELETE", "/v1/files/{file_id}", "file_id"): FILES,
    ("GET", "/v1/files", "after"): FILES,
    ("GET", "/v1/batches/{batch_id}", "batch_id"): ("batch",),
    ("POST", "/v1/batches/{batch_id}/cancel", "batch_id"): ("batch",),
    ("GET", "/v1/batches", "after"): ("batch",),
    ("POST", "/v1/batches", "input_file_id"): FILES,
    ("GET", "/v1/responses/{response_id}", "response_id"): ("response",),
    ("DELETE", "/v1/responses/{response_id}", "response_id"): ("response",),
    ("POST", "/v1/responses/{response_id}/cancel", "response_id"): ("response",),
    ("POST", "/v1/responses", "previous_response_id"): ("response",),
    # not ids of anything a key owns:
    ("GET", "/v1/models/{model}", "model"): NO_OWNED_ID,  # models are every key's
    ("GET", "/v1/jobs/{job_id}/events", "after"): NO_OWNED_ID,  # an event's seq
}
"""Every operation's id-taking parameter, and the kinds of B's things to call it with."""

LISTINGS = ("/v1/files", "/v1/files?purpose=batch_output", "/v1/files?purpose=batch", "/v1/batches")


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    param: str
    where: str
    """`path`, `query` or `body`."""


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _keyed(settings: Settings) -> Settings:
    return Settings(
        **{
            **settings.model_dump(),
            "api_keys": [A, B],
            "max_attempts": 1,
            "batch_poll_s": 0.05,
        }
    )


def _takes_an_id(name: str) -> bool:
    return name in ("after", "before", "id") or name.endswith("_id")


def id_operations(doc: dict[str, Any]) -> Iterator[Operation]:
    """Every parameter of the document's operations that may name an id: each path
    parameter, query parameters named like ids or cursors, JSON body fields named `*_id`."""
    schemas = doc.get("components", {}).get("schemas", {})
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            m = method.upper()
            for p in op.get("parameters", []):
                if p["in"] == "path" or (p["in"] == "query" and _takes_an_id(p["name"])):
                    yield Operation(m, path, p["name"], p["in"])
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            schema = body.get("schema", {})
            if "$ref" in schema:
                schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
            for name in schema.get("properties", {}):
                if _takes_an_id(name):
                    yield Operation(m, path, name, "body")


def _unknown(kind: str) -> str:
    """A well-formed id of this kind that names nothing."""
    hex32 = uuid.uuid4().hex
    if kind in FILES:
        return f"file-{hex32}"
    if kind == "batch":
        return f"batch_{hex32}"
    if kind == "response":
        return f"resp_{hex32}"
    return hex32


@dataclass
class Things:
    """B's things by kind."""

    ids: dict[str, str] = field(default_factory=dict)


def _completion(custom_id: str, prompt: str) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "sim", "prompt": prompt, "max_tokens": 3},
    }


async def _upload(c: httpx.AsyncClient, key: str, lines: list[dict[str, Any]]) -> str:
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    r = await c.post(
        "/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": "batch"},
        headers=_h(key),
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


async def _until(
    c: httpx.AsyncClient, url: str, key: str, field_: str, values: tuple[str, ...]
) -> dict[str, Any]:
    async with asyncio.timeout(WAIT_S):
        while True:
            body: dict[str, Any] = (await c.get(url, headers=_h(key))).json()
            if body.get(field_) in values:
                return body
            await asyncio.sleep(POLL_S)


async def _make(stack: Stack) -> Things:
    """As B: a job run to its end, and a batch of two lines (one fails) run to completion."""
    c = stack.client
    job = await c.post(
        "/v1/jobs", json={"model": "sim", "prompt": "b", "max_tokens": 3}, headers=_h(B)
    )
    assert job.status_code == 202, job.text
    file_id = await _upload(c, B, [_completion("ok", "fine"), _completion("bad", POISON)])
    r = await c.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/completions"},
        headers=_h(B),
    )
    assert r.status_code == 200, r.text
    batch = await _until(c, f"/v1/batches/{r.json()['id']}", B, "status", ("completed",))
    assert batch["output_file_id"] and batch["error_file_id"], batch
    await _until(c, f"/v1/jobs/{job.json()['id']}", B, "status", ("succeeded",))
    body = {"model": "sim", "input": "b's", "max_output_tokens": 3}
    response = await c.post("/v1/responses", json=body, headers=_h(B))
    assert response.status_code == 200, response.text
    return Things(
        {
            "job": job.json()["id"],
            "batch_job": batch_job_id(batch["id"], 1),
            "input_file": file_id,
            "output_file": batch["output_file_id"],
            "error_file": batch["error_file_id"],
            "batch": batch["id"],
            "response": response.json()["id"],
        }
    )


async def _call(c: httpx.AsyncClient, op: Operation, value: str) -> tuple[int, str]:
    """The operation as A with `value` for its parameter: (status, body with the id masked)."""
    url, params, body = op.path, {}, None
    if op.where == "path":
        url = url.replace("{" + op.param + "}", value)
    elif op.where == "query":
        params = {op.param: value}
    elif op.path == "/v1/responses":
        body = {"model": "sim", "input": "x", "max_output_tokens": 2, op.param: value}
    else:
        body = {op.param: value, "endpoint": "/v1/completions"}
    r = await c.request(op.method, url, params=params, json=body, headers=_h(A))
    return r.status_code, r.text.replace(value, "<id>")


async def _snapshot(c: httpx.AsyncClient, things: Things) -> dict[str, Any]:
    """What B reads of its things (the parts nobody but B should be able to change)."""
    ids = things.ids
    out: dict[str, Any] = {}
    for kind in JOBS:
        job = (await c.get(f"/v1/jobs/{ids[kind]}", headers=_h(B))).json()
        out[kind] = (job["status"], job["text"])
    for kind in FILES:
        r = await c.get(f"/v1/files/{ids[kind]}/content", headers=_h(B))
        out[kind] = (r.status_code, r.text)
    batch = (await c.get(f"/v1/batches/{ids['batch']}", headers=_h(B))).json()
    out["batch"] = (batch["status"], batch["request_counts"])
    r = await c.get(f"/v1/responses/{ids['response']}", headers=_h(B))
    out["response"] = (r.status_code, r.json().get("status"), r.json().get("output"))
    return out


@pytest.mark.parametrize("redis", ["redis"], indirect=True)
async def test_no_route_reaches_another_keys_things(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(_keyed(settings), redis, poison_marker=POISON) as stack:
        c = stack.client
        doc = (await c.get("/openapi.json")).json()
        operations = list(id_operations(doc))
        missing = {(o.method, o.path, o.param) for o in operations} - COVERED.keys()
        assert not missing, f"operations that take an id, not in COVERED: {sorted(missing)}"
        stale = COVERED.keys() - {(o.method, o.path, o.param) for o in operations}
        assert not stale, f"COVERED names operations the document no longer has: {stale}"

        # A's own file, older than B's things: a page after one of B's ids would show it
        own = await _upload(c, A, [_completion("a", "mine")])
        things = await _make(stack)
        before = await _snapshot(c, things)
        leaks = []
        for op in operations:
            for kind in COVERED[(op.method, op.path, op.param)]:
                theirs = await _call(c, op, things.ids[kind])
                nobodys = await _call(c, op, _unknown(kind))
                if theirs != nobodys:
                    leaks.append((op.method, op.path, op.param, kind, theirs, nobodys))
        assert not leaks, "\n".join(map(str, leaks))

        for listing in LISTINGS:
            r = await c.get(listing, headers=_h(A))
            assert r.status_code == 200, r.text
            shown = {x["id"] for x in r.json()["data"]}
            assert not shown & set(things.ids.values()), (listing, shown)
        mine = (await c.get("/v1/files", headers=_h(A))).json()["data"]
        assert [x["id"] for x in mine] == [own]  # A's listing works: it shows A's file
        assert await _snapshot(c, things) == before  # A's deletes and cancels changed nothing


@pytest.mark.parametrize("redis", ["redis"], indirect=True)
async def test_result_files_written_without_an_owner_are_their_batchs(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """Output and error files as the old finalizer wrote them (no owner): their batch's
    owner reads them, lists them and deletes them; another key gets the 404 of a file that
    is not, and its listings never show them."""
    keys = Keys(settings.key_prefix)
    async with running_stack(_keyed(settings), redis, poison_marker=POISON) as stack:
        c = stack.client
        things = await _make(stack)
        results = [things.ids["output_file"], things.ids["error_file"]]
        for file_id in results:
            assert await redis.hdel(keys.file(file_id), "owner") == 1
        for file_id, custom_id in zip(results, ("ok", "bad"), strict=True):
            theirs = await c.get(f"/v1/files/{file_id}/content", headers=_h(A))
            assert theirs.status_code == 404, theirs.text
            mine = await c.get(f"/v1/files/{file_id}/content", headers=_h(B))
            assert mine.status_code == 200, mine.text
            [line] = mine.text.splitlines()
            assert json.loads(line)["custom_id"] == custom_id
        listed = {
            key: {x["id"] for x in (await c.get("/v1/files", headers=_h(key))).json()["data"]}
            for key in (A, B)
        }
        assert not listed[A] & set(results) and set(results) <= listed[B]
        assert (await c.delete(f"/v1/files/{results[0]}", headers=_h(A))).status_code == 404
        assert (await c.delete(f"/v1/files/{results[0]}", headers=_h(B))).status_code == 200
