"""A body's long lists and its prompt's length in ids are read from a raw scan before anything
parses it: the routes (tests/integration/test_hostile_input.py) and a batch file's lines, here."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.batch import lines
from gateway.batch.lines import LineChecker, LineProblem
from gateway.body_scan import MAX_SCANNED_PROMPTS, Counter, longest_prompt
from gateway.openai.protocol import MAX_CHAT_MESSAGES, ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + 1)


def _line(url: str, body: dict) -> bytes:
    return json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}).encode()


def test_the_limits_are_the_models_own() -> None:
    assert Counter(ChatCompletionRequest).limits == {"messages": MAX_CHAT_MESSAGES}
    assert Counter(CompletionRequest).limits == {}


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": "not a list"}',
        b'{"messages": [1, 2',
        b"[1, 2, 3]",
        b'{"model": "m"}',
        json.dumps({"messages": MESSAGES[:MAX_CHAT_MESSAGES]}).encode(),
    ],
)
def test_what_the_scan_cannot_judge_goes_on_to_the_parse(body: bytes) -> None:
    assert Counter(ChatCompletionRequest).first_too_long(body) is None


async def test_a_batch_line_over_its_message_limit_is_refused_before_it_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = {"model": "sim", "messages": MESSAGES}
    parsed: list[bytes] = []
    loads = json.loads

    def counting(s: str | bytes, *a: object, **k: object) -> object:
        parsed.append(s if isinstance(s, bytes) else s.encode())
        return loads(s, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(json, "loads", counting)
    # refused before the line needs the gateway's state (no model is looked up)
    problem = await LineChecker(None).check(3, _line("/v1/chat/completions", body))  # type: ignore[arg-type]
    assert not parsed
    with pytest.raises(ValidationError) as pydantics:
        ChatCompletionRequest.model_validate(body)
    assert isinstance(problem, LineProblem)
    assert (problem.line, problem.param) == (3, "body.messages")
    assert problem.message == pydantics.value.errors()[0]["msg"]


def test_a_completion_line_is_not_counted_by_the_chat_limit() -> None:
    """`messages` is no field of a completion (ignored, as any unknown field)."""
    body = {"model": "sim", "prompt": "x", "messages": MESSAGES}
    lines._count_lists(_line("/v1/completions", body))  # does not raise


@pytest.mark.parametrize(
    ("body", "found"),
    [
        (b'{"model": "m", "input_ids": [1, 2, 3]}', ("m", 3)),
        (b'{"model": "m", "input_ids": [ 1 , 2 ,3 ] }', ("m", 3)),
        (b'{"model": "m", "prompt": [5, 6]}', ("m", 2)),
        (b'{"model": "m", "prompt": [[1], [1, 2, 3, 4], []]}', ("m", 4)),
        (b'{"model": "m", "prompt": "text, with, commas"}', None),
        (b'{"model": "m", "prompt": ["a, b", "c"]}', None),
        (b'{"model": "m", "input_ids": ["1,2,3"]}', None),
        (b'{"model": "m", "input_ids": [{"a": 1}, 2]}', None),
        (b'{"model": "m", "input_ids": []}', None),
        (b'{"model": "m", "input_ids": null}', None),
        (b'{"input_ids": [1, 2]}', None),
        (b'{"model": "m", "input_ids": [1, 2', None),
        (b"[1, 2, 3]", None),
    ],
)
def test_a_prompts_length_in_ids_is_read_from_the_raw_body(
    body: bytes, found: tuple[str, int] | None
) -> None:
    """Counted from the commas of an array of numbers only: strings, objects and nesting it
    cannot count leave the judgement to the full check."""
    assert longest_prompt(body) == found


def test_past_the_scanned_prompts_the_full_check_counts() -> None:
    many = json.dumps({"model": "m", "prompt": [[1]] * (MAX_SCANNED_PROMPTS + 1)}).encode()
    assert longest_prompt(many) is None
    few = json.dumps({"model": "m", "prompt": [[1]] * MAX_SCANNED_PROMPTS}).encode()
    assert longest_prompt(few) == ("m", 1)


def test_a_body_nested_too_deeply_for_the_scan_goes_on_to_the_parse() -> None:
    deep = b'{"model": "m", "messages": [' + b"[" * 5000 + b"]" * 5000 + b"]}"
    assert Counter(ChatCompletionRequest).first_too_long(deep) is None
    assert longest_prompt(deep.replace(b"messages", b"input_ids")) is None
    lines._count_lists(_line("/v1/chat/completions", {}).replace(b"{}", deep))  # no raise
