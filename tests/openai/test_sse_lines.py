"""U+2028, U+2029 and U+0085 in a streamed reply: every SSE stream (native, completions, chat,
responses) escapes them in its `data:` lines, so a client that splits lines as
`str.splitlines` does (httpx's `aiter_lines`) reads each frame whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.openai.conftest import API_KEY, CHAT, GenqServer

SEPARATORS = "a\u2028b\u2029c\x85d"
"""The reply a `regex` constraint forces: each separator a character of several bytes."""
FIELDS = ("id: ", "event: ", "data: ", ":")


def _native(d: dict[str, Any]) -> str:
    return str(d.get("text", "")) if d.get("type") == "token" else ""


def _completion(d: dict[str, Any]) -> str:
    return "".join(c.get("text", "") for c in d.get("choices", []))


def _chat(d: dict[str, Any]) -> str:
    return "".join(c["delta"].get("content") or "" for c in d.get("choices", []))


def _response(d: dict[str, Any]) -> str:
    return str(d["delta"]) if d.get("type") == "response.output_text.delta" else ""


ASK = [{"role": "user", "content": "Hi"}]
STREAMS: list[tuple[str, dict[str, Any], Callable[[dict[str, Any]], str]]] = [
    ("/v1/jobs", {"prompt": "Hi"}, _native),
    ("/v1/completions", {"prompt": "Hi"}, _completion),
    ("/v1/chat/completions", {"messages": ASK}, _chat),
    ("/v1/responses", {"input": "Hi"}, _response),
]


@pytest.mark.parametrize(("route", "body", "text_of"), STREAMS, ids=[s[0] for s in STREAMS])
async def test_line_separators_in_a_reply_keep_each_sse_line_whole(
    server: GenqServer,
    route: str,
    body: dict[str, Any],
    text_of: Callable[[dict[str, Any]], str],
) -> None:
    body = {**body, "model": CHAT, "stream": True, "regex": SEPARATORS, "max_tokens": 30}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = ""
    async with (
        httpx.AsyncClient(base_url=server.url, headers=headers) as client,
        client.stream("POST", route, json=body) as r,
    ):
        assert r.status_code in (200, 202)
        async for line in r.aiter_lines():
            assert not line or line.startswith(FIELDS), repr(line)
            if line.startswith("data: {"):
                text += text_of(json.loads(line.removeprefix("data: ")))
    assert text == SEPARATORS
