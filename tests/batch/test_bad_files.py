"""Bad input files and batch requests: each a clear 400 (413 for a limit) naming the line and
the field, and nothing created: no file, no stored chunk, no batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.batch.conftest import (
    MAX_BYTES,
    MAX_LINES,
    Serve,
    chat_line,
    completion_line,
    jsonl,
)


def _stored(db: redis.Redis, genq: Serve) -> int:
    """Keys of files (records, content, uploads in progress) and batches under the prefix."""
    kinds = ("file:", "filedata:", "fileupload:", "batch:")
    keys = db.scan_iter(match=f"{genq.prefix}*", count=SCAN_COUNT)
    return sum(k.removeprefix(genq.prefix).startswith(kinds) for k in keys)


def _refused(
    client: openai.OpenAI, db: redis.Redis, genq: Serve, content: bytes
) -> openai.APIStatusError:
    before = _stored(db, genq)
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("bad.jsonl", content), purpose="batch")
    assert _stored(db, genq) == before, "a refused upload left something behind"
    return caught.value


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict)
    return body if "message" in body else body["error"]


GOOD = chat_line("good", "hi")
SCAN_COUNT = 10_000


@pytest.mark.parametrize(
    ("lines", "line", "param", "says"),
    [
        ([GOOD, "{not json"], 2, None, "not JSON"),
        ([GOOD, '["a list"]'], 2, None, "JSON object"),
        ([chat_line("same", "a"), GOOD, chat_line("same", "b")], 3, "custom_id", "line 1"),
        ([{**GOOD, "url": "/v1/embeddings"}], 1, "url", "/v1/chat/completions"),
        ([{**GOOD, "method": "GET"}], 1, "method", "POST"),
        ([{k: v for k, v in GOOD.items() if k != "custom_id"}], 1, "custom_id", "required"),
        ([GOOD, chat_line("m", "hi", model="nope")], 2, "body.model", "'nope' is not served"),
        ([chat_line("t", "hi", temperature=7)], 1, "body.temperature", "less than or equal"),
        ([chat_line("k", "hi", max_tokens=10**6)], 1, "body.max_tokens", "context length"),
        ([chat_line("u", "hi", tools=[{"type": "function"}])], 1, "body.tools.0", "must be"),
        ([chat_line("n", "hi", n=2)], 1, "body.n", "one completion"),
        ([chat_line("s", "hi", stream=True)], 1, "body.stream", "not streamed"),
        ([completion_line("p", "")], 1, "body.prompt", "at least 1 character"),
        ([completion_line("p", ["a", "b"])], 1, "body.prompt", "one"),
        ([GOOD, "", chat_line("after", "blank")], 2, None, "empty"),
    ],
)
def test_a_bad_line_is_a_400_naming_it(
    client: openai.OpenAI,
    db: redis.Redis,
    genq: Serve,
    lines: list[Any],
    line: int,
    param: str | None,
    says: str,
) -> None:
    exc = _refused(client, db, genq, jsonl(lines))
    assert exc.status_code == 400
    error = _error(exc)
    assert error["code"] == "invalid_batch_file"
    where = f"line {line}" + (f", {param}" if param else "")
    assert where in error["message"] and says in error["message"], error["message"]
    assert error["param"] == f"line {line}" + (f": {param}" if param else "")


def test_the_400_names_the_first_bad_lines(
    client: openai.OpenAI, db: redis.Redis, genq: Serve
) -> None:
    lines: list[Any] = [GOOD] + [chat_line(f"x{i}", "hi", temperature=9) for i in range(30)]
    message = _error(_refused(client, db, genq, jsonl(lines)))["message"]
    assert "line 2, body.temperature" in message and "line 11, body.temperature" in message
    assert "line 12," not in message  # checking stops at the first ten


def test_trailing_blank_lines_are_fine(client: openai.OpenAI) -> None:
    f = client.files.create(file=("ok.jsonl", jsonl([GOOD]) + b"\n\r\n"), purpose="batch")
    assert f.bytes == len(jsonl([GOOD])) + 3


def test_over_the_line_limit_is_a_413(client: openai.OpenAI, db: redis.Redis, genq: Serve) -> None:
    lines = [completion_line(f"l{i}", "a", max_tokens=1) for i in range(MAX_LINES + 1)]
    exc = _refused(client, db, genq, jsonl(lines))
    assert exc.status_code == 413
    assert str(MAX_LINES) in _error(exc)["message"] and "GENQ_BATCH_MAX_LINES" in exc.message


def test_over_the_size_limit_is_a_413(client: openai.OpenAI, db: redis.Redis, genq: Serve) -> None:
    big = completion_line("big", "word " * (MAX_BYTES // 4))
    exc = _refused(client, db, genq, jsonl([GOOD, big]))
    assert exc.status_code == 413
    assert str(MAX_BYTES) in _error(exc)["message"] and "GENQ_FILE_MAX_BYTES" in exc.message


@pytest.mark.contract
@pytest.mark.parametrize(
    ("form", "param"),
    [
        (lambda f: {"data": {"purpose": "fine-tune"}, "files": {"file": f}}, "purpose"),
        (lambda f: {"data": {"purpose": "batch"}}, "file"),
        (lambda f: {"files": {"file": f}}, "purpose"),
    ],
)
def test_a_bad_form_is_a_400(
    genq: Serve, db: redis.Redis, form: Callable[[Any], dict[str, Any]], param: str
) -> None:
    before = _stored(db, genq)
    r = httpx.post(f"{genq.url}/v1/files", **form(("in.jsonl", jsonl([GOOD]))))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert _stored(db, genq) == before


def test_a_json_body_is_not_an_upload(genq: Serve) -> None:
    r = httpx.post(f"{genq.url}/v1/files", json={"purpose": "batch"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]


def test_bad_batch_requests(client: openai.OpenAI, db: redis.Redis, genq: Serve) -> None:
    chat = client.files.create(file=("c.jsonl", jsonl([GOOD])), purpose="batch")
    before = _stored(db, genq)
    cases: list[tuple[dict[str, Any], type[openai.APIStatusError], str]] = [
        ({"input_file_id": "file-" + "0" * 32}, openai.NotFoundError, "input_file_id"),
        ({"endpoint": "/v1/completions"}, openai.BadRequestError, "endpoint"),
        ({"endpoint": "/v1/embeddings"}, openai.UnprocessableEntityError, "endpoint"),
        ({"completion_window": "48h"}, openai.UnprocessableEntityError, "completion_window"),
        ({"completion_window": "soon"}, openai.UnprocessableEntityError, "completion_window"),
        ({"metadata": {"k" * 65: "v"}}, openai.BadRequestError, "metadata"),
    ]
    for change, error, param in cases:
        body = {
            "input_file_id": chat.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **change,
        }
        with pytest.raises(error) as caught:
            client.batches.create(**body)
        assert _error(caught.value)["param"].startswith(param), caught.value.body
    assert _stored(db, genq) == before, "a refused batch left something behind"
