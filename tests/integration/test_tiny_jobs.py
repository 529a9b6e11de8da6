"""Short batch jobs at the engine's pace, on real Redis with an in-process sim worker: a batch
job's events go out in few writes (its flush interval, not one write a token), its end
acknowledges its queue entry in the same write, and a slot a batch job leaves is taken at the
engine's next step (a job started ahead waits at the engine's doorstep), not a step later."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from shared.keys import CONSUMER_GROUP
from shared.settings import Settings
from tests.conftest import REDIS_URL, Stack, running_stack
from worker.claims import Claimer
from worker.engine_client import EngineProcess
from worker.jobstate import Claim

FLUSH_TOKENS = 16
FLUSH_JOBS = 16
WRITES_PER_JOB = 8
"""At most this many event writes for a batch job of FLUSH_TOKENS tokens (one a step, 16 or
17, before batch jobs flushed at their own interval)."""
WAVES = 8
SLOTS = 4
"""The sim's batch: one slot is the interactive reserve (a quarter), three run batch jobs."""
BATCH_SLOTS = SLOTS - 1
TINY_TOKENS = 4
TINY_JOBS = 24
SLACK_STEPS = 4
"""Steps the worker may lose over the whole run (a wave it was late for, on a busy box)."""
STEP_MS = 50.0
DONE_WITHIN_S = 60.0


async def _submit_batch(stack: Stack, n: int, max_tokens: int) -> list[str]:
    jobs = []
    for i in range(n):
        job = await stack.submit(prompt=f"classify {i}", max_tokens=max_tokens, priority="batch")
        jobs.append(job["id"])
    return jobs


async def _all_done(stack: Stack, jobs: list[str]) -> list[dict[str, Any]]:
    return [await stack.wait_status(j, "succeeded", timeout=DONE_WITHIN_S) for j in jobs]


async def test_a_batch_jobs_tokens_go_out_in_few_writes(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    settings = settings.model_copy(update={"sim_step_ms": 20.0, "max_batch": FLUSH_JOBS * 2})
    async with running_stack(settings, redis) as stack:
        tx = stack.worker.st.transitions
        writes: dict[str, int] = {}
        emit = tx.emit

        def counted(job_id: str, **kw: Any) -> Any:
            writes[job_id] = writes.get(job_id, 0) + 1
            return emit(job_id, **kw)

        tx.emit = counted  # type: ignore[method-assign]
        jobs = await _submit_batch(stack, FLUSH_JOBS, FLUSH_TOKENS)
        done = await _all_done(stack, jobs)
        texts = [await _streamed_text(stack, j) for j in jobs]
        queue = stack.worker.st.queues["batch"]
        pending = await redis.xpending(queue, CONSUMER_GROUP)
        left = await redis.xlen(queue)
    for record, text in zip(done, texts, strict=True):
        assert record["usage"]["completion_tokens"] == FLUSH_TOKENS
        assert text == record["text"]  # folded tokens: the same text, in order
    assert max(writes[j] for j in jobs) <= WRITES_PER_JOB, writes
    # each end acknowledged (and deleted) its queue entry in the write that ended it
    assert pending["pending"] == 0 and left == 0


async def test_a_tiny_batch_job_is_written_once(settings: Settings, redis) -> None:  # type: ignore[no-untyped-def]
    """A batch job that ends within its flush interval of its first token goes out in one
    write: its `started`, its tokens and its end together (two or three before: `started`
    and the first tokens went at the interval's next tick), and its log holds every event."""
    # steps of 10 ms: a job's first token to its end is 30 ms of the 100 ms interval
    settings = settings.model_copy(update={"sim_step_ms": 10.0, "max_batch": TINY_JOBS * 2})
    async with running_stack(settings, redis) as stack:
        tx = stack.worker.st.transitions
        writes: dict[str, int] = {}
        emit = tx.emit

        def counted(job_id: str, **kw: Any) -> Any:
            writes[job_id] = writes.get(job_id, 0) + 1
            return emit(job_id, **kw)

        tx.emit = counted  # type: ignore[method-assign]
        jobs = await _submit_batch(stack, TINY_JOBS, TINY_TOKENS)
        await _all_done(stack, jobs)
        logs = [await _event_types(stack, j) for j in jobs]
    # a step late here and there on a busy box may split a job in two
    assert sum(writes[j] for j in jobs) <= TINY_JOBS * 5 // 4, writes
    assert max(writes[j] for j in jobs) <= 2, writes
    for types in logs:  # every event, the tokens folded into one (two for a job split)
        assert types[:3] == ["queued", "started", "token"] and types[-1] == "done", types
        assert set(types[3:-1]) <= {"token"}, types
    assert sum(len(types) == len(["queued", "started", "token", "done"]) for types in logs) >= (
        TINY_JOBS * 3 // 4
    ), logs


async def _event_types(stack: Stack, job_id: str) -> list[str]:
    r = await stack.client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "0"})
    return [
        line[len("event:") :].strip() for line in r.text.splitlines() if line.startswith("event:")
    ]


async def _streamed_text(stack: Stack, job_id: str) -> str:
    """The job's text as its event log replays it (every token event, in order)."""
    r = await stack.client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "0"})
    text = []
    for line in r.text.splitlines():
        if line.startswith("data:") and '"type":"token"' in line.replace(" ", ""):
            text.append(json.loads(line[len("data:") :])["text"])
    return "".join(text)


@contextlib.asynccontextmanager
async def _engine_stack(settings: Settings) -> AsyncIterator[Stack]:
    """A running stack whose worker drives an engine process (the doorstep is there)."""
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    link = await EngineProcess.spawn(settings)
    try:
        async with running_stack(settings, redis, link=link) as stack:
            yield stack
    finally:
        await redis.aclose()


async def _run_waves(settings: Settings) -> tuple[int, int]:
    """WAVES waves of batch jobs of TINY_TOKENS tokens through an engine process: the engine
    steps they took, and the worker's lead (tokens ahead) at the end."""
    async with _engine_stack(settings) as stack:
        times = stack.worker.st.engine.times
        before = times.steps
        jobs = await _submit_batch(stack, WAVES * BATCH_SLOTS, TINY_TOKENS)
        await _all_done(stack, jobs)
        return times.steps - before, stack.worker.st.ahead_tokens()


async def test_a_slot_a_batch_job_leaves_is_taken_at_the_next_step(settings: Settings) -> None:
    """Waves of batch jobs of TINY_TOKENS tokens through BATCH_SLOTS slots of an engine
    process: each wave takes TINY_TOKENS steps when the next wave waits at the engine's
    doorstep; a wave started once its slots are free (the claim, its START, the add after the
    step) takes one step more."""
    settings = settings.model_copy(
        update={"sim_step_ms": STEP_MS, "max_batch": SLOTS, "sim_prefill_ms_per_1k": 0.0}
    )
    steps, _ = await _run_waves(settings)
    assert steps <= WAVES * TINY_TOKENS + SLACK_STEPS, steps


START_STEPS = 3
"""The injected START's time in steps: longer than the two tokens a fixed lead allowed."""


async def test_claims_start_as_far_ahead_as_their_way_in_takes(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A START that takes START_STEPS steps (a busy or distant Redis; 240 STARTs on the 2-core
    box took 45-90 ms, three or four 20 ms steps): the worker measures the claims' way in and
    starts them that many steps ahead, so each wave still waits at the engine's doorstep and the
    engine never idles between waves. With the lead fixed at two tokens, each wave came a step
    or two after its slots were free."""
    settings = settings.model_copy(
        update={"sim_step_ms": STEP_MS, "max_batch": SLOTS, "sim_prefill_ms_per_1k": 0.0}
    )
    start = Claimer._start

    async def slow_start(self: Claimer, ready: list[Claim]) -> Any:
        await asyncio.sleep(START_STEPS * STEP_MS / 1000)
        return await start(self, ready)

    monkeypatch.setattr(Claimer, "_start", slow_start)
    steps, lead = await _run_waves(settings)
    assert lead > START_STEPS, lead
    assert steps <= WAVES * TINY_TOKENS + SLACK_STEPS, steps


RUNAWAY_JOBS = 60


async def test_claims_started_ahead_stay_within_two_batch_slots_worth(settings: Settings) -> None:
    """Jobs of 2 tokens, shorter than the lead: a claim started ahead waits at the doorstep
    with all its tokens left. It used to count as a job about to end, so each start ahead let
    one more start: on the drain bench the worker held ~3,900 started jobs for 256 slots
    (engine and worker CPU spent scanning them). Now the jobs started and not ended stay
    within the engine's slots and two batch slots' worth at its doorstep."""
    settings = settings.model_copy(
        update={"sim_step_ms": 20.0, "max_batch": SLOTS, "sim_prefill_ms_per_1k": 0.0}
    )
    async with _engine_stack(settings) as stack:
        st = stack.worker.st
        held: list[int] = []

        async def watch() -> None:
            while True:
                held.append(st.in_engine())
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        try:
            jobs = await _submit_batch(stack, RUNAWAY_JOBS, 2)
            await _all_done(stack, jobs)
        finally:
            watcher.cancel()
        assert max(held) <= SLOTS + 2 * BATCH_SLOTS, max(held)
