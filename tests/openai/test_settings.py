"""Settings and request parsing: GENQ_DEFAULT_CHAT_TEMPLATE on the gateway, GENQ_CHAT_TEMPLATE
on the worker (inline, or a file read at start); unknown request fields."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from gateway.openai.protocol import ChatCompletionRequest
from shared.settings import Settings
from tests.conftest import REDIS_URL, running_stack
from tests.openai.conftest import CHATML

USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis]:
    """Real Redis only: with fakeredis the gateway's pub/sub receiver can outlive its cancel
    at shutdown after a non-streaming request (see the report of issue 3)."""
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    await client.aclose()


async def test_default_template_serves_models_without_one(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings, redis, chat_template=None) as bare:
        r = await bare.client.post("/v1/chat/completions", json={"model": "sim", "messages": USER})
        assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_missing"
    with_default = settings.model_copy(update={"default_chat_template": CHATML})
    async with running_stack(with_default, redis, chat_template=None) as stack:
        body = {"model": "sim", "messages": USER, "max_tokens": 3}
        r = await stack.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3


def test_a_template_setting_is_inline_or_a_file(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(CHATML)
    assert Settings(chat_template=str(path)).chat_template == CHATML
    assert Settings(default_chat_template=CHATML).default_chat_template == CHATML
    with pytest.raises(ValidationError, match="no chat template file"):
        Settings(chat_template=str(tmp_path / "missing.jinja"))


def test_unknown_request_fields_are_ignored_with_a_debug_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = {"model": "sim", "messages": USER, "reasoning_effort": "low", "modalities": ["text"]}
    with caplog.at_level(logging.DEBUG, logger="gateway.openai.protocol"):
        req = ChatCompletionRequest.model_validate(body)
    assert req.model == "sim"
    [record] = [r for r in caplog.records if r.message == "ignoring unknown request fields"]
    assert record.fields == ["modalities", "reasoning_effort"]  # type: ignore[attr-defined]
