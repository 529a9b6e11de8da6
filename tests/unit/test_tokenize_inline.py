"""gateway/job_service.py: a short prompt is tokenized on the event loop, a long one in a
thread. The hop to a thread and back cost the gateway more CPU than a short prompt's
tokenizing (~0.13 ms against ~0.03 ms), a few per cent of the CPU pipeline's speed (measured on
the 2-core dev box)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.job_service import INLINE_CHARS, JobService
from gateway.registry import ModelRegistry
from shared.keys import Keys
from shared.settings import Settings
from shared.transitions import ScriptRunner
from worker.sim import build_tokenizer


class _Recording:
    """The sim's tokenizer, noting the thread each encode ran on."""

    def __init__(self) -> None:
        self._tok = build_tokenizer()
        self.threads: list[int] = []

    def encode_batch(self, texts: list[str], **kw: Any) -> Any:
        self.threads.append(threading.get_ident())
        return self._tok.encode_batch(texts, **kw)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


@pytest.fixture
def service() -> JobService:
    settings = Settings()
    redis = aioredis.Redis()  # never connected: tokenizing touches no key
    registry = ModelRegistry(redis, Keys(settings.key_prefix), settings.card_cache_s)
    return JobService(settings, redis, ScriptRunner(redis), registry)


def _loaded(tok: _Recording) -> Any:
    return SimpleNamespace(tokenizer=tok, card=SimpleNamespace(add_bos=False, bos_token=None))


async def test_a_short_prompt_is_tokenized_on_the_loop(service: JobService) -> None:
    tok = _Recording()
    prompt = "hello world, the quick brown fox " * 4
    assert len(prompt) <= INLINE_CHARS
    ids = await service._tokenize(_loaded(tok), prompt)
    assert tok.threads == [threading.get_ident()]
    assert ids == tok._tok.encode(prompt, add_special_tokens=False).ids


async def test_a_long_prompt_is_tokenized_in_a_thread(service: JobService) -> None:
    tok = _Recording()
    prompt = "x" * (INLINE_CHARS + 1)
    ids = await service._tokenize(_loaded(tok), prompt)
    assert len(tok.threads) == 1 and tok.threads[0] != threading.get_ident()
    assert ids == tok._tok.encode(prompt, add_special_tokens=False).ids
