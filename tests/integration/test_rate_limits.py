"""Per-key tokens per minute (issue 33, "Fair shares by tokens"): a job's prompt + max_tokens
charged when it is admitted, from one bucket per key shared by all gateways; 429 with
Retry-After past it, 400 for a request no minute could admit; OpenAI's x-ratelimit-* headers
on every answer to a keyed request; a key's own limits from the keys file; the OpenAI SDK
sees a RateLimitError with the headers."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from gateway.deps import identify
from shared.settings import Settings
from tests.conftest import gateway_only, gateways, running_stack

A, B, C = "key-a", "key-b", "key-c"
JOB = {"model": "sim", "prompt": "x", "max_tokens": 40}
"""41 tokens: a prompt of one token and max_tokens."""
_DURATION = re.compile(r"(?:(\d+)m)?(?:([\d.]+)s)?|(\d+)ms")


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _with(settings: Settings, **more: object) -> Settings:
    return Settings(**{**settings.model_dump(), **more})


def _tokens(r: httpx.Response) -> tuple[int, int, float]:
    """The tokens headers: limit, remaining, reset (seconds)."""
    h = r.headers
    limit, left = int(h["x-ratelimit-limit-tokens"]), int(h["x-ratelimit-remaining-tokens"])
    return limit, left, _seconds(h["x-ratelimit-reset-tokens"])


def _seconds(text: str) -> float:
    m = _DURATION.fullmatch(text)
    assert m is not None, text
    minutes, seconds, millis = m.groups()
    if millis:
        return int(millis) / 1000
    return int(minutes or 0) * 60 + float(seconds or 0)


def _throttled(r: httpx.Response) -> str:
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "rate_limited" and error["type"] == "rate_limit_error"
    assert "tokens per minute" in error["message"]
    return str(error["message"])


async def test_tokens_per_minute_are_charged_at_admission_and_shared_by_gateways(
    settings: Settings, redis: aioredis.Redis
) -> None:
    await tokens_per_minute_flow(
        _with(settings, api_keys=[A, B], tokens_per_minute_per_key=100), redis
    )


async def tokens_per_minute_flow(limited: Settings, redis: aioredis.Redis) -> None:
    """Run on one Redis here, and on a cluster (tests/integration/test_cluster.py)."""
    async with gateways(limited, redis, 2) as (one, two):
        r = await one.post("/v1/jobs", json=JOB, headers=_h(A))
        assert r.status_code == 202
        limit, left, reset = _tokens(r)
        assert (limit, left) == (100, 59) and 24 < reset <= 24.6  # 41 tokens at 100/60 a s
        # the same bucket (it refills at 1.67 tokens a second: a slow run may see one more)
        r = await two.post("/v1/jobs", json=JOB, headers=_h(A))
        assert r.status_code == 202 and _tokens(r)[0] == 100 and _tokens(r)[1] in (18, 19)
        over = await one.post("/v1/jobs", json=JOB, headers=_h(A))
        message = _throttled(over)
        assert "GENQ_TOKENS_PER_MINUTE_PER_KEY" in message and "needs 41 tokens" in message
        assert int(over.headers["retry-after"]) in (13, 14)  # 22-23 more tokens: 13-14 s
        assert _tokens(over)[0] == 100 and _tokens(over)[1] in (18, 19)
        small = await two.post("/v1/jobs", json={**JOB, "max_tokens": 10}, headers=_h(A))
        left = _tokens(small)[1]
        assert small.status_code == 202 and left in (7, 8)  # the refusal cost nothing
        never = await one.post("/v1/jobs", json={**JOB, "max_tokens": 200}, headers=_h(A))
        assert never.status_code == 400 and never.json()["error"]["param"] == "max_tokens"
        assert "100 tokens per minute" in never.json()["error"]["message"]
        last = await two.post("/v1/jobs", json={**JOB, "max_tokens": left - 1}, headers=_h(A))
        assert last.status_code == 202 and _tokens(last)[1] == 0
        empty = await one.post("/v1/jobs", json={**JOB, "max_tokens": 1}, headers=_h(A))
        assert "none are left" in _throttled(empty)  # refused before it is tokenized
        assert empty.headers["retry-after"] == "1"  # one token: 0.6 s
        look = await one.get(f"/v1/jobs/{r.json()['id']}", headers=_h(A))
        assert look.status_code == 200 and _tokens(look)[:2] == (100, 0)  # read, not charged
        other = await two.post("/v1/jobs", json=JOB, headers=_h(B))
        assert other.status_code == 202 and _tokens(other)[:2] == (100, 59)


async def test_a_keys_file_sets_a_keys_own_limits_and_weight(
    settings: Settings, redis: aioredis.Redis, tmp_path: Path
) -> None:
    await keys_file_flow(settings, redis, tmp_path)


async def keys_file_flow(settings: Settings, redis: aioredis.Redis, tmp_path: Path) -> None:
    """Run on one Redis here, and on a cluster (tests/integration/test_cluster.py)."""
    path = tmp_path / "keys"
    path.write_text(f"{A} tpm=50 rpm=120 weight=3  # a tenant\n{B}\n{C} tpm=0\n")
    limited = _with(settings, api_keys_file=path, tokens_per_minute_per_key=1000)
    assert identify(limited, A).options.weight == 3
    assert identify(limited, B).options.weight is None
    async with gateway_only(limited, redis) as c:
        a = await c.post("/v1/jobs", json=JOB, headers=_h(A))
        assert a.status_code == 202 and _tokens(a)[:2] == (50, 9)
        assert a.headers["x-ratelimit-limit-requests"] == "2"  # 2/s: bursts of one second's
        assert "its tpm= in the keys file" in _throttled(
            await c.post("/v1/jobs", json=JOB, headers=_h(A))
        )
        b = await c.post("/v1/jobs", json=JOB, headers=_h(B))
        assert b.status_code == 202 and _tokens(b)[:2] == (1000, 959)
        assert "x-ratelimit-limit-requests" not in b.headers
        for _ in range(3):  # tpm=0: no limit for this key, the setting's notwithstanding
            r = await c.post("/v1/jobs", json={**JOB, "max_tokens": 2000}, headers=_h(C))
            assert r.status_code == 202 and "x-ratelimit-limit-tokens" not in r.headers


async def test_the_openai_sdk_sees_the_headers_and_a_rate_limit_error(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """A request of several jobs is charged whole with its first: admitted or refused whole."""
    limited = _with(settings, api_keys=[A], tokens_per_minute_per_key=300)
    async with running_stack(limited, redis) as stack:
        # the stack's client reaches the gateway app in-process (and stays the stack's)
        client = openai.AsyncOpenAI(
            base_url="http://genq/v1", api_key=A, http_client=stack.client, max_retries=0
        )
        create = client.completions.with_raw_response.create
        raw = await create(model="sim", prompt="x", max_tokens=99)
        assert raw.headers["x-ratelimit-limit-tokens"] == "300"
        assert raw.headers["x-ratelimit-remaining-tokens"] == "200"
        with pytest.raises(openai.RateLimitError) as err:  # 300 tokens: one job's would fit
            await client.completions.create(model="sim", prompt="x", max_tokens=99, n=3)
        headers = err.value.response.headers
        assert err.value.code == "rate_limited" and "tokens per minute" in str(err.value)
        assert int(headers["retry-after"]) in (19, 20)  # ~100 more tokens at 5 a second
        assert int(headers["x-ratelimit-remaining-tokens"]) in (200, 201, 202)
        both = await create(model="sim", prompt="x", max_tokens=99, n=2)  # fits: none charged
        assert int(both.headers["x-ratelimit-remaining-tokens"]) < 3
        assert len(both.parse().choices) == 2
