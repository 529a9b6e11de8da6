"""The official openai SDK, unchanged, against a real `genq serve`: files.create →
batches.create → batches.retrieve → files.content; the output lines are the live endpoint's
responses; cancel and expiry keep what finished and fail the rest, every line exactly once."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
import redis
from openai.types import Completion
from openai.types.chat import ChatCompletion

from shared.batches import batch_job_id
from shared.schemas import TERMINAL_STATUSES
from tests.batch.conftest import (
    POISON,
    POLL_S,
    Serve,
    by_custom_id,
    chat_line,
    completion_line,
    jsonl,
    results,
    run_batch,
    wait_ended,
    wait_for_progress,
)

CANCEL_WITHIN_S = 5.0
JOBS_END_WITHIN_S = 5.0
"""A cancelled batch is `cancelled` within this (the issue: within seconds)."""
LONG_LINES = 300
LONG_TOKENS = 64
"""A batch of LONG_LINES x LONG_TOKENS runs several seconds on the test's sim engine."""


@pytest.mark.contract
def test_a_chat_batch_returns_what_the_live_endpoint_returns(client: openai.OpenAI) -> None:
    lines = [
        chat_line(f"req-{i}", f"question {i}", seed=i, max_tokens=3 + i % 4) for i in range(40)
    ]
    batch = run_batch(client, lines)
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.request_counts is not None
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (40, 40, 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out = by_custom_id(results(client, batch.output_file_id))
    assert sorted(out) == sorted(x["custom_id"] for x in lines)
    for line in lines[:5]:
        got = out[line["custom_id"]]
        assert got["error"] is None and got["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(got["response"]["body"])
        live = client.chat.completions.create(**line["body"])
        assert body.choices[0].message.content == live.choices[0].message.content
        assert body.choices[0].finish_reason == live.choices[0].finish_reason == "length"
        assert body.usage == live.usage
        assert body.id == f"chatcmpl-{got['response']['request_id']}"
    assert batch.usage is not None and batch.usage.output_tokens == sum(
        x["body"]["max_tokens"] for x in lines
    )
    output = client.files.retrieve(batch.output_file_id or "")
    assert output.purpose == "batch_output" and output.bytes > 0


def test_a_completions_batch_keeps_logprobs(client: openai.OpenAI) -> None:
    lines = [completion_line(f"c{i}", "the model", seed=i, logprobs=2) for i in range(5)]
    batch = run_batch(client, lines, endpoint="/v1/completions")
    out = by_custom_id(results(client, batch.output_file_id))
    for line in lines:
        body = Completion.model_validate(out[line["custom_id"]]["response"]["body"])
        live = client.completions.create(**line["body"])
        assert body.choices[0].text == live.choices[0].text
        assert body.choices[0].logprobs == live.choices[0].logprobs
        assert body.choices[0].logprobs is not None and body.choices[0].logprobs.tokens


def test_a_constrained_completions_batch_fits_its_schema_as_the_live_one(
    client: openai.OpenAI,
) -> None:
    """Batch lines carry a constraint as the live endpoint's body does; the results fit it and
    equal the live answers; a file with a line whose constraint cannot run is refused, the
    line and the field named, as the live endpoint's 400 would name it."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
        "required": ["n", "tag"],
        "additionalProperties": False,
    }
    lines = [
        completion_line(f"j{i}", "numbers", seed=i, max_tokens=40, json_schema=schema)
        for i in range(4)
    ]
    bad = [*lines, completion_line("bad", "numbers", max_tokens=5, regex="(unclosed")]
    with pytest.raises(openai.BadRequestError, match=r"line 5, body\.regex: regex: this regex"):
        run_batch(client, bad, endpoint="/v1/completions")
    batch = run_batch(client, lines, endpoint="/v1/completions")
    assert batch.status == "completed"
    out = by_custom_id(results(client, batch.output_file_id))
    for line in lines:
        body = Completion.model_validate(out[line["custom_id"]]["response"]["body"])
        jsonschema.validate(json.loads(body.choices[0].text), schema)
        args = {k: v for k, v in line["body"].items() if k != "json_schema"}
        live = client.completions.create(**args, extra_body={"json_schema": schema})
        assert body.choices[0].text == live.choices[0].text


def test_failed_requests_go_to_the_error_file(client: openai.OpenAI) -> None:
    lines = [
        chat_line("ok-1", "fine"),
        chat_line("bad", f"a {POISON} here"),
        chat_line("ok-2", "x"),
    ]
    batch = run_batch(client, lines)
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    out = by_custom_id(results(client, batch.output_file_id))
    err = by_custom_id(results(client, batch.error_file_id))
    assert sorted(out) == ["ok-1", "ok-2"] and list(err) == ["bad"]
    assert err["bad"]["response"] is None
    assert err["bad"]["error"]["code"] == "max_attempts_exceeded"


def test_batches_list_pages(client: openai.OpenAI) -> None:
    made = [run_batch(client, [chat_line("only", f"page {i}")]).id for i in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0]
    every = [b.id for b in client.batches.list(limit=2)]  # the SDK follows the pages
    assert every[:3] == made[::-1] and len(every) == len(set(every))


PAGED_FILES = 5


@pytest.mark.contract
def test_files_list_get_and_delete(client: openai.OpenAI) -> None:
    f = client.files.create(file=("mine.jsonl", jsonl([chat_line("a", "b")])), purpose="batch")
    assert f.filename == "mine.jsonl" and f.purpose == "batch" and f.status == "processed"
    assert f.expires_at is not None and f.expires_at - f.created_at == 30 * 86_400
    assert client.files.retrieve(f.id) == f
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert client.files.content(f.id).content == jsonl([chat_line("a", "b")])
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    assert f.id not in [x.id for x in client.files.list()]


def test_files_list_pages_by_after_limit_and_order(client: openai.OpenAI) -> None:
    made = {
        client.files.create(file=(f"p{i}.jsonl", jsonl([chat_line("a", "b")])), purpose="batch").id
        for i in range(PAGED_FILES)
    }
    try:
        first = client.files.list(limit=2, order="asc")
        assert len(first.data) == 2 and first.has_more
        for order, step in (("asc", 1), ("desc", -1)):
            seen = list(client.files.list(limit=2, order=order))  # the SDK follows `after`
            ids = [f.id for f in seen]
            assert len(ids) == len(set(ids)) and made <= set(ids)
            times = [f.created_at for f in seen]
            assert times == sorted(times, reverse=step < 0)
    finally:
        for file_id in made:
            client.files.delete(file_id)


def test_request_counts_grow_while_the_batch_runs(client: openai.OpenAI) -> None:
    lines = [
        chat_line(f"c{i}", f"count {i}", seed=i, max_tokens=LONG_TOKENS) for i in range(LONG_LINES)
    ]
    f = client.files.create(file=("counts.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    try:
        early = wait_for_progress(client, batch.id, 1)
        assert early.status == "in_progress" and early.in_progress_at is not None
        assert early.request_counts is not None and early.request_counts.total == LONG_LINES
        assert 0 < early.request_counts.completed < LONG_LINES
        later = wait_for_progress(client, batch.id, early.request_counts.completed + 1)
        assert later.request_counts is not None
        assert later.request_counts.completed > early.request_counts.completed
    finally:
        client.batches.cancel(batch.id)
        wait_ended(client, batch.id)


def test_cancel_keeps_what_finished_and_fails_the_rest(
    client: openai.OpenAI, db: redis.Redis, genq: Serve
) -> None:
    lines = [
        chat_line(f"r{i}", f"long {i}", seed=i, max_tokens=LONG_TOKENS) for i in range(LONG_LINES)
    ]
    f = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for_progress(client, batch.id, 1)
    asked = time.monotonic()
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    ended = wait_ended(client, batch.id)
    assert ended.status == "cancelled" and time.monotonic() - asked < CANCEL_WITHIN_S
    assert ended.cancelling_at and ended.cancelled_at
    _every_line_once(client, ended, [x["custom_id"] for x in lines])
    err = results(client, ended.error_file_id)
    assert err and {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert ended.request_counts is not None and ended.request_counts.completed >= 1
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change
    _all_jobs_end(db, genq, batch.id, LONG_LINES)


def test_a_batch_past_its_window_expires(
    client: openai.OpenAI, db: redis.Redis, genq: Serve
) -> None:
    lines = [
        chat_line(f"e{i}", f"late {i}", seed=i, max_tokens=LONG_TOKENS) for i in range(LONG_LINES)
    ]
    batch = run_batch(client, lines, window="2s")
    assert batch.status == "expired" and batch.expired_at
    _every_line_once(client, batch, [x["custom_id"] for x in lines])
    err = results(client, batch.error_file_id)
    assert {x["error"]["code"] for x in err} == {"batch_expired"}
    assert batch.request_counts is not None and batch.request_counts.completed >= 1
    _all_jobs_end(db, genq, batch.id, LONG_LINES)  # none left queued or running


def test_cancelling_an_ended_batch_is_a_conflict(client: openai.OpenAI) -> None:
    batch = run_batch(client, [chat_line("x", "y")])
    with pytest.raises(openai.ConflictError, match="completed"):
        client.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 32)


def _every_line_once(client: openai.OpenAI, batch: openai.types.Batch, ids: list[str]) -> None:
    out = by_custom_id(results(client, batch.output_file_id))
    err = by_custom_id(results(client, batch.error_file_id))
    assert not set(out) & set(err), "a line in both files"
    assert sorted([*out, *err]) == sorted(ids)
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(out), len(err))
    assert all(x["error"] is None for x in out.values())


def _all_jobs_end(db: redis.Redis, genq: Serve, batch_id: str, lines: int) -> None:
    """Every job of the batch ends soon after it: queued ones at once, running ones once their
    worker has stopped them (within a second)."""

    def ended() -> bool:
        pipe = db.pipeline(transaction=False)
        for n in range(1, lines + 1):
            pipe.hget(f"{genq.prefix}job:{{{batch_job_id(batch_id, n)}}}", "status")
        return all(x is None or x in TERMINAL_STATUSES for x in pipe.execute())

    deadline = time.monotonic() + JOBS_END_WITHIN_S
    while not ended():
        assert time.monotonic() < deadline, f"jobs of {batch_id} still queued or running"
        time.sleep(POLL_S)
