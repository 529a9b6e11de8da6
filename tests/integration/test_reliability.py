"""Deadlines and poison jobs, through the gateway app and an in-process sim worker."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from shared.settings import Settings
from tests.conftest import Stack, parse_sse, running_stack
from worker.lease import LeaseClock, reclaimable

LONG = 5000  # tokens: at 1 ms a step, seconds of work


async def _final_event(stack: Stack, job_id: str) -> tuple[str, dict]:
    r = await stack.client.get(f"/v1/jobs/{job_id}/events")
    events = parse_sse(r.text)
    return events[-1][1], events[-1][2]


async def test_running_job_past_its_deadline_ends_expired(stack: Stack) -> None:
    job = await stack.submit(prompt="the model", max_tokens=LONG, timeout_s=0.3)
    await stack.wait_status(job["id"], "running")
    ended = await stack.wait_status(job["id"], "expired", "succeeded", timeout=5)
    assert ended["status"] == "expired"
    assert ended["error"]["code"] == "deadline_exceeded"
    etype, data = await _final_event(stack, job["id"])
    assert etype == "error" and data["code"] == "deadline_exceeded"


async def test_queued_job_past_its_deadline_ends_expired_without_a_free_worker(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings.model_copy(update={"max_batch": 1}), redis) as stack:
        busy = await stack.submit(prompt="the model", max_tokens=LONG)
        await stack.wait_status(busy["id"], "running")
        job = await stack.submit(prompt="the model", max_tokens=10, timeout_s=0.3)
        ended = await stack.wait_status(job["id"], "expired", timeout=5)
        assert ended["error"]["code"] == "deadline_exceeded"
        assert (await stack.client.get(f"/v1/jobs/{busy['id']}")).json()["status"] == "running"
        etype, data = await _final_event(stack, job["id"])
        assert etype == "error" and data["code"] == "deadline_exceeded"
        await stack.client.delete(f"/v1/jobs/{busy['id']}")


async def test_poison_job_is_dead_lettered_while_its_batch_goes_on(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings, redis, poison_marker="POISON") as stack:
        poison = await stack.submit(prompt="a POISON pill", max_tokens=20)
        healthy = [await stack.submit(prompt=f"job {i}", max_tokens=200) for i in range(4)]
        ended = await stack.wait_status(poison["id"], "failed")
        assert ended["attempt"] == settings.max_attempts
        assert ended["error"]["code"] == "max_attempts_exceeded"
        assert "poison marker" in ended["error"]["message"]
        for job in healthy:
            done = await stack.wait_status(job["id"], "succeeded")
            assert done["attempt"] == 1 and done["usage"]["completion_tokens"] == 200
        dead: list[tuple[str, dict[str, str]]] = await redis.xrange(  # type: ignore[assignment]
            stack.worker.st.keys.dead_letters()
        )
        assert [d["job"] for _, d in dead] == [poison["id"]]


def test_reclaim_takes_entries_of_dead_owners_and_own_unheld_ones_only() -> None:
    pending = [("1-0", "dead"), ("2-0", "alive"), ("3-0", "me"), ("4-0", "me")]
    assert reclaimable(pending, "me", held={"3-0"}, alive={"alive"}) == ["1-0", "4-0"]


def test_poison_marker_is_off_by_default() -> None:
    assert Settings().sim_poison_marker is None


# A job's log as a Redis restart that lost its last ARGV[1] writes leaves it: rebuilt without
# them, atomically (XDEL would not do: the stream would still remember its top id).
_LOSE_TAIL = """
local entries = redis.call('XRANGE', KEYS[1], '-', '+')
redis.call('DEL', KEYS[1])
for i = 1, #entries - tonumber(ARGV[1]) do
  redis.call('XADD', KEYS[1], entries[i][1], unpack(entries[i][2]))
end
return redis.call('XLEN', KEYS[1])
"""


async def test_worker_rewrites_events_redis_lost_so_the_log_has_no_hole(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings, redis, step_ms=20) as stack:
        job = await stack.submit(prompt="the model", max_tokens=100)
        events_key = stack.worker.st.keys.events(job["id"])

        async def wait_log(n: int) -> None:  # a poll: Redis offers nothing to await here
            while await redis.xlen(events_key) < n:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(wait_log(6), 5)
        await redis.eval(_LOSE_TAIL, 1, events_key, 3)
        done = await stack.wait_status(job["id"], "succeeded")
        r = await stack.client.get(f"/v1/jobs/{job['id']}/events")
        events = parse_sse(r.text)
        assert [e[0] for e in events] == list(range(1, len(events) + 1))
        assert events[-1][1] == "done"
        assert "".join(e[2]["text"] for e in events if e[1] == "token") == done["text"]
        assert sum(e[2]["count"] for e in events if e[1] == "token") == 100


async def test_job_whose_record_cannot_be_read_is_dead_lettered_and_claiming_goes_on(
    stack: Stack,
) -> None:
    keys, bad = stack.worker.st.keys, "f" * 32
    await stack.redis.hset(keys.job(bad), mapping={"spec": "{not json", "status": "queued"})
    await stack.redis.xadd(keys.queue("sim", "interactive"), {"job": bad, "tokens": 10})
    healthy = await stack.submit(prompt="the model", max_tokens=5)
    assert (await stack.wait_status(healthy["id"], "succeeded"))["attempt"] == 1

    async def failed() -> bool:
        return await stack.redis.hget(keys.job(bad), "status") == "failed"

    async with asyncio.timeout(10):
        while not await failed():
            await asyncio.sleep(0.02)
    error = await stack.redis.hget(keys.job(bad), "error")
    assert error is not None and "could not begin the job" in error


async def test_a_job_whose_keys_redis_rejects_does_not_block_the_others(stack: Stack) -> None:
    keys = stack.worker.st.keys
    damaged = await stack.submit(prompt="the model", max_tokens=LONG)
    await stack.wait_status(damaged["id"], "running")
    # SET replaces the stream in one command (WRONGTYPE from now on); a DELETE first left a
    # moment without a log, which the worker may read as a log lost beyond repair instead
    await stack.redis.set(keys.events(damaged["id"]), "not a stream")
    healthy = [await stack.submit(prompt=f"job {i}", max_tokens=20) for i in range(3)]
    for job in healthy:
        assert (await stack.wait_status(job["id"], "succeeded"))["attempt"] == 1
    record = await stack.redis.hgetall(keys.job(damaged["id"]))
    assert record["status"] == "queued" and "WRONGTYPE" in record["last_error"]


def test_lease_clock_waits_a_lease_after_an_outage_before_reclaiming() -> None:
    clock = LeaseClock(lease_s=60.0)
    assert clock.held() and clock.reclaim_allowed()  # a fresh worker may reclaim at once
    clock.beat_failed()
    assert not clock.reclaim_allowed()
    clock.beat_ok()
    assert clock.held() and not clock.reclaim_allowed()  # Redis is back: give others a lease
    clock.ok_since = (clock.ok_since or 0.0) - 60.0
    assert clock.reclaim_allowed()
    clock.last_ok -= 60.0
    assert not clock.held()  # paused past the lease: claims may have moved


async def test_a_retried_job_claimed_again_by_its_worker_is_not_cancelled_by_its_old_attempt(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """The engine is mid-step (150 ms) when attempt 1 is handed back; the same worker claims
    and starts attempt 2 before the engine confirms attempt 1's stop. That confirmation must
    not end attempt 2 (issue 12, item 1: it ended `cancelled` although nobody cancelled it)."""
    async with running_stack(settings, redis, step_ms=150) as stack:
        job = await stack.submit(prompt="handed back", max_tokens=12)
        st = stack.worker.st
        async with asyncio.timeout(10):
            while not (job["id"] in st.running and st.running[job["id"]].token_ids):
                await asyncio.sleep(0.01)
        run = st.running[job["id"]]
        run.retry_error = "engine failed the job (test)"  # what an engine error sets
        st.dirty.add(run.id)
        st.flush_wanted.set()
        done = await stack.wait_status(job["id"], "succeeded", "cancelled", "failed", timeout=20)
        assert done["status"] == "succeeded", done
        assert done["attempt"] == 2
