"""A finished job costs Redis little: past GENQ_EVENT_COMPACT_GRACE_S its event log becomes a
compact form in its record (gateway.compaction, shared/compact.py), and what a client can
still ask for stays the same: a resume from any Last-Event-ID gets the same text, token ids,
logprobs and final event; GET /v1/jobs/{id} answers the same; an OpenAI replay streams the
same reply. Real Redis only (MEMORY USAGE)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.compaction import COMPACTED, Compactor
from shared.keys import Keys
from shared.settings import Settings
from shared.transitions import ScriptRunner
from tests.conftest import REDIS_URL, Stack, parse_sse, running_stack

GRACE_S = 3600
"""Long: the gateway's own sweep leaves the jobs to the test, which compacts them itself."""
LATER_S = 2 * GRACE_S
LONG_TOKENS = 1000
PER_TEXT_BYTE = 1.5
SLACK_BYTES = 1024
"""The target: a finished job's keys hold at most 1.5 bytes a byte of its text, plus 1 KB."""


@pytest.fixture
async def real_redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def stack(settings: Settings, real_redis: aioredis.Redis) -> AsyncIterator[Stack]:
    # flushes every ~2 steps: a long job's log holds hundreds of events, as under load
    s = settings.model_copy(
        update={
            "event_compact_grace_s": GRACE_S,
            "flush_interval_ms": 2.0,
            "sim_step_ms": 1.0,
            "event_page_entries": 3,
            "stream_buffer_bytes": 4096,
        }
    )
    async with running_stack(s, real_redis) as st:
        yield st


def compactor(st: Stack) -> Compactor:
    return Compactor(st.settings, st.redis, ScriptRunner(st.redis), Keys(st.settings.key_prefix))


async def finished(st: Stack, **body: Any) -> dict[str, Any]:
    job = await st.submit(prompt="tell me a story", **body)
    return await st.wait_status(job["id"], "succeeded", timeout=30)


async def job_bytes(st: Stack, job_id: str) -> int:
    """MEMORY USAGE (every element counted) summed over the job's keys."""
    total = 0
    async for key in st.redis.scan_iter(match=f"{st.settings.key_prefix}*{{{job_id}}}*"):
        total += await st.redis.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0")
    return total


async def resume(st: Stack, job_id: str, after: int) -> list[tuple[int, str, dict]]:
    r = await st.client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(after)})
    assert r.status_code == 200, r.text
    return parse_sse(r.text)


def folded(frames: list[tuple[int, str, dict]]) -> dict[str, Any]:
    """What a client takes from a stream: text, ids, logprobs, count; the other events whole."""
    tokens = [d for _, t, d in frames if t == "token"]
    return {
        "text": "".join(d["text"] for d in tokens),
        "ids": [i for d in tokens for i in d["token_ids"]],
        "count": sum(d["count"] for d in tokens),
        "logprobs": [e for d in tokens for e in d.get("logprobs") or []],
        "others": [(s, t, d) for s, t, d in frames if t != "token"],
        "seqs_rise": all(a[0] < b[0] for a, b in itertools.pairwise(frames)),
    }


async def test_a_finished_long_job_costs_at_most_1_5x_its_text(stack: Stack) -> None:
    job = await finished(stack, max_tokens=LONG_TOKENS)
    text_bytes = len(job["text"].encode())
    before = await job_bytes(stack, job["id"])
    assert await compactor(stack).sweep(now=time.time() + LATER_S) >= 1
    after = await job_bytes(stack, job["id"])
    assert after <= PER_TEXT_BYTE * text_bytes + SLACK_BYTES, (before, after, text_bytes)
    assert not await stack.redis.exists(stack.worker.st.keys.events(job["id"]))


@pytest.mark.parametrize("logprobs", [None, 2])
async def test_a_resume_from_any_event_gets_the_same_after_compaction(
    stack: Stack, logprobs: int | None
) -> None:
    job = await finished(stack, max_tokens=120, logprobs=logprobs)
    full = await resume(stack, job["id"], 0)
    last = full[-1][0]
    assert full[-1][1] == "done" and last > 6  # many token events to resume between
    before = {n: folded(await resume(stack, job["id"], n)) for n in range(last + 1)}
    view = (await stack.client.get(f"/v1/jobs/{job['id']}")).json()

    assert await compactor(stack).compact(job["id"]) == COMPACTED
    for n in range(last + 1):
        frames = await resume(stack, job["id"], n)
        assert folded(frames) == before[n], n
        assert all(s > n for s, _, _ in frames)
    assert before[0]["text"] == job["text"]
    assert bool(before[0]["logprobs"]) == (logprobs is not None)
    assert (await stack.client.get(f"/v1/jobs/{job['id']}")).json() == view


async def test_each_synthesized_event_is_a_resume_point(stack: Stack) -> None:
    job = await finished(stack, max_tokens=2000)
    assert await compactor(stack).compact(job["id"]) == COMPACTED
    frames = await resume(stack, job["id"], 2)  # queued, started: then pages of tokens
    tokens = [(s, d["text"]) for s, t, d in frames if t == "token"]
    assert len(tokens) > 1  # paged: ~10 KB of text, 4 KB pages
    for i, (seq, _) in enumerate(tokens):
        rest = folded(await resume(stack, job["id"], seq))
        assert rest["text"] == "".join(t for _, t in tokens[i + 1 :])
        assert rest["others"] == [f for f in frames if f[1] != "token" and f[0] > seq]


async def test_an_openai_replay_streams_the_same_reply_after_compaction(stack: Stack) -> None:
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 80,
        "stream": True,
    }
    headers = {"Idempotency-Key": f"k-{time.time_ns()}"}

    async def reply() -> tuple[str, str | None]:
        r = await stack.client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        chunks = [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
        ]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        reasons = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
        return text, next((x for x in reasons if x), None)

    first = await reply()
    job_id = None
    async for key in stack.redis.scan_iter(match=f"{stack.settings.key_prefix}job:*"):
        job_id = key.rpartition("{")[2].rstrip("}")  # the one job of this test
    assert job_id is not None
    await stack.wait_status(job_id, "succeeded")
    assert await compactor(stack).compact(job_id) == COMPACTED
    assert await reply() == first
    assert first[0] and first[1] == "length"


async def test_compacting_twice_or_after_the_log_changed_is_harmless(stack: Stack) -> None:
    job = await finished(stack, max_tokens=60)
    c, keys = compactor(stack), stack.worker.st.keys
    full = folded(await resume(stack, job["id"], 0))
    entries = await stack.redis.xrange(keys.events(job["id"]))
    stale = c.transitions.compact(
        job["id"], last_seq=1, entries=len(entries), fields={"log": "~x", "result": "~x"}
    )
    assert await c.scripts.run(stale) == "changed"  # read before the log's end: not written
    assert folded(await resume(stack, job["id"], 0)) == full
    assert await c.compact(job["id"]) == COMPACTED
    record = await stack.redis.hgetall(keys.job(job["id"]))
    assert await c.compact(job["id"]) == "skipped"
    assert await stack.redis.hgetall(keys.job(job["id"])) == record
    assert not await stack.redis.zscore(keys.compact_due(), job["id"])
    assert folded(await resume(stack, job["id"], 0)) == full


async def test_a_sweep_killed_midway_leaves_every_job_whole(stack: Stack) -> None:
    jobs = [await stack.submit(prompt=f"p{i}", max_tokens=40) for i in range(30)]
    for j in jobs:
        await stack.wait_status(j["id"], "succeeded", timeout=30)
    full = {j["id"]: folded(await resume(stack, j["id"], 0)) for j in jobs}
    code = (
        "import asyncio, time, redis.asyncio as r\n"
        "from gateway.compaction import Compactor\n"
        "from shared.keys import Keys\nfrom shared.settings import Settings\n"
        "from shared.transitions import ScriptRunner\n"
        "async def main():\n"
        f"    c = r.Redis.from_url({REDIS_URL!r}, decode_responses=True)\n"
        f"    s = Settings(redis_url={REDIS_URL!r}, key_prefix={stack.settings.key_prefix!r})\n"
        "    k = Compactor(s, c, ScriptRunner(c), Keys(s.key_prefix))\n"
        "    print('ready', flush=True)\n"
        f"    await k.sweep(now=time.time() + {LATER_S})\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    assert (await proc.stdout.readline()).strip() == b"ready"
    await asyncio.sleep(0.05)  # somewhere in the sweep (or past it)
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    for j in jobs:  # compacted or untouched, each: what a client reads is the same
        assert folded(await resume(stack, j["id"], 0)) == full[j["id"]]
    await compactor(stack).sweep(now=time.time() + LATER_S)
    keys = stack.worker.st.keys
    assert not await stack.redis.zcard(keys.compact_due())
    for j in jobs:
        assert not await stack.redis.exists(keys.events(j["id"]))
        assert folded(await resume(stack, j["id"], 0)) == full[j["id"]]


async def test_a_gateway_compacts_ended_jobs_by_itself(
    settings: Settings, real_redis: aioredis.Redis
) -> None:
    s = settings.model_copy(update={"event_compact_grace_s": 0, "event_compact_sweep_s": 0.05})
    async with running_stack(s, real_redis) as st:
        job = await finished(st, max_tokens=30)
        keys = st.worker.st.keys
        async with asyncio.timeout(5):
            while await st.redis.exists(keys.events(job["id"])):
                await asyncio.sleep(0.02)
        assert await st.redis.hexists(keys.job(job["id"]), "log")
        assert (await resume(st, job["id"], 0))[-1][1] == "done"
        assert 0 < await st.redis.ttl(keys.job(job["id"])) <= s.retention_s
