"""SIGKILL the gateway serving OpenAI streams (cancel-on-disconnect, the default): their jobs
are cancelled once the gateway's lease and the grace have passed, instead of running on unread
while the client retries; a job its client resumed on another gateway runs to completion."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import openai
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from tests.chaos.harness import Stream, follow, until
from tests.chaos.scenarios import KEYS, Env

LEASE_S = 1.0
GRACE_S = 1.0
PRESENCE = {
    "GENQ_GATEWAY_HEARTBEAT_S": "0.2",
    "GENQ_GATEWAY_LEASE_S": str(LEASE_S),
    "GENQ_ORPHAN_GRACE_S": str(GRACE_S),
}
STEP_MS = 50
ORPHAN_TOKENS = 2000
"""Minutes of work at STEP_MS: only a cancel ends these jobs within the test."""
RESUMED_TOKENS = 200
"""About 10 s at STEP_MS: still running well after the dead gateway's jobs are cancelled."""
CANCELLED_WITHIN_S = LEASE_S + GRACE_S + 10
TIMEOUT_S = 30.0
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "stream me"}]


class OpenAIStream:
    """An OpenAI SDK chat stream read in the background until it ends or breaks."""

    def __init__(self, stream: openai.AsyncStream[ChatCompletionChunk]) -> None:
        self.stream = stream
        self.job_ids: list[str] = stream.response.headers["x-job-ids"].split(",")
        self.tokens = 0
        self.broke: BaseException | None = None
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for chunk in self.stream:
                self.tokens += sum(bool(c.delta.content) for c in chunk.choices)
        except Exception as exc:  # the gateway died: the SDK's connection error
            self.broke = exc


async def _open(sdk: openai.AsyncOpenAI, max_tokens: int, n: int = 1) -> OpenAIStream:
    stream = await sdk.chat.completions.create(
        model="sim", messages=USER, max_tokens=max_tokens, n=n, stream=True
    )
    return OpenAIStream(stream)


async def test_jobs_streamed_by_a_dead_gateway_are_cancelled_unless_resumed(env: Env) -> None:
    first = env.cluster.gateway(**PRESENCE)
    second = env.cluster.gateway(**PRESENCE)
    env.worker("--step-ms", str(STEP_MS))
    sdk = openai.AsyncOpenAI(base_url=f"{first.url}/v1", api_key="none", max_retries=0)
    orphaned = await _open(sdk, ORPHAN_TOKENS, n=2)
    kept = await _open(sdk, RESUMED_TOKENS)
    native_body = {"model": "sim", "prompt": "native", "max_tokens": ORPHAN_TOKENS}
    native = env.http.build_request(
        "POST",
        f"{first.url}/v1/jobs",
        json={**native_body, "stream": True, "cancel_on_disconnect": True},
    )
    native_response = await env.http.send(native, stream=True)
    orphans = [*orphaned.job_ids, native_response.headers["x-job-id"]]
    # The client of `kept` follows its job on the second gateway too (X-Job-Ids tells it how).
    [kept_id] = kept.job_ids
    resumed = Stream(body={}, job_id=kept_id)
    follower = asyncio.create_task(follow(env.http, lambda: [second.url], resumed))

    async def under_way() -> bool:
        return orphaned.tokens > 0 and kept.tokens > 0 and bool(resumed.events)

    await until(under_way, TIMEOUT_S, "every stream under way")
    first.kill()
    killed_at = time.time()

    async def orphans_cancelled() -> bool:
        statuses = [await env.redis.hget(KEYS.job(j), "status") for j in orphans]
        return statuses == ["cancelled"] * len(orphans)

    await until(orphans_cancelled, CANCELLED_WITHIN_S, "the dead gateway's jobs cancelled")
    assert await env.redis.hget(KEYS.job(kept_id), "status") == "running"
    for job_id in orphans:
        record = await env.record(job_id)
        after_s = float(record["finished_at"]) - killed_at
        print(f"job {job_id} cancelled {after_s:.2f} s after its gateway died")
        assert after_s >= GRACE_S  # not before the grace
        last = (await env.log(job_id))[-1]
        assert last["type"] == "cancelled" and "gateway" in last["reason"]
    await asyncio.wait_for(follower, TIMEOUT_S)
    assert resumed.events[-1].type == "done"
    assert (await env.record(kept_id))["status"] == "succeeded"
    assert orphaned.broke is not None  # what the SDK client saw of the gateway's death
    with contextlib.suppress(Exception):
        await native_response.aclose()
    await sdk.close()
    assert json.loads((await env.record(kept_id))["usage"])["completion_tokens"] == RESUMED_TOKENS
