"""The batch contract in shared/: a job that ends tells its batch's done stream in the same
step (EMIT, SETTLE), each line's result is written once whatever calls race, status changes
are compare-and-sets under the batch's lease, and the records round-trip."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import fakeredis
import pytest
import redis.asyncio as aioredis

from shared import events
from shared.batch_transitions import BatchTransitions, LineResult, Updated
from shared.batches import (
    BatchError,
    BatchRecord,
    FileRecord,
    batch_job_id,
    new_batch_id,
    result_file_id,
    window_seconds,
)
from shared.events import CancelledEvent, DoneEvent, TokenEvent
from shared.keys import Keys
from shared.quotas import Admission
from shared.records import ANONYMOUS, JobRecord, QueueEntry
from shared.schemas import JobSpec, Sampling, Timings, Usage
from shared.transitions import ScriptRunner, Transitions
from tests.conftest import REDIS_URL, test_prefix

STREAM_FIELD = "job"


@pytest.fixture(params=["redis", "fakeredis"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    if request.param == "redis":
        c = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    else:
        c = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    prefix = test_prefix()
    c.genq_keys = Keys(prefix)  # type: ignore[attr-defined]
    yield c
    keys = [k async for k in c.scan_iter(match=f"{prefix}*")]
    if keys:
        await c.delete(*keys)
    await c.aclose()


def _keys(client: aioredis.Redis) -> Keys:
    return client.genq_keys  # type: ignore[attr-defined,no-any-return]


async def _submit(client: aioredis.Redis, done_stream: str | None) -> str:
    keys = _keys(client)
    job_id = uuid.uuid4().hex
    spec = JobSpec(
        id=job_id,
        model="m",
        input_ids=[1, 2],
        max_tokens=3,
        sampling=Sampling(),
        priority="batch",
        created_at=1.0,
    )
    record = JobRecord(spec=spec, status="queued", done_stream=done_stream, owner=ANONYMOUS)
    queued = events.QueuedEvent(seq=1, id=job_id, model="m", priority="batch", prompt_tokens=2)
    call = Transitions(keys).submit(
        record,
        queued_event=events.encode(queued),
        entry=QueueEntry(job=job_id, tokens=5),
        idempotency_key=None,
        idempotency_claim="",
        idempotency_ttl_s=60,
        admission=Admission(tokens=5, check_at=1.0),
    )
    await ScriptRunner(client).run(call)
    return job_id


async def _told(client: aioredis.Redis, stream: str) -> list[str]:
    return [f[STREAM_FIELD] for _, f in await client.xrange(stream)]


async def test_a_job_that_ends_by_emit_tells_its_done_stream_once(client: aioredis.Redis) -> None:
    keys, tx, runner = _keys(client), Transitions(_keys(client)), ScriptRunner(client)
    stream = keys.batch_done("batch_x")
    job_id = await _submit(client, stream)
    await runner.run(tx.start(job_id, worker="w", now=2.0, max_attempts=3, max_interruptions=5))
    token = TokenEvent(seq=2, attempt=1, text="a", token_ids=[5], count=1)
    running = tx.emit(job_id, worker="w", attempt=1, events=[(2, events.encode(token))], maxlen=99)
    await runner.run(running)
    assert await _told(client, stream) == []  # still running: nothing told
    done = DoneEvent(seq=3, attempt=1, finish_reason="length", usage=Usage(), timings=Timings())
    end = tx.emit(
        job_id,
        worker="w",
        attempt=1,
        events=[(3, events.encode(done))],
        maxlen=99,
        fields=JobRecord.fields(status="succeeded"),
        retention_s=60,
    )
    await runner.run(end)
    assert await _told(client, stream) == [job_id]
    await runner.run(end)  # a retried write: fenced (the job ended), nothing told again
    assert await _told(client, stream) == [job_id]


async def test_a_job_settled_tells_its_done_stream(client: aioredis.Redis) -> None:
    keys, tx, runner = _keys(client), Transitions(_keys(client)), ScriptRunner(client)
    stream = keys.batch_done("batch_x")
    job_id = await _submit(client, stream)
    plain = await _submit(client, None)
    for j in (job_id, plain):
        settle = tx.settle(
            j,
            status="queued",
            attempt=0,
            last_seq=1,
            event=(2, events.encode(CancelledEvent(seq=2))),
            fields=JobRecord.fields(status="cancelled"),
            maxlen=99,
            retention_s=60,
        )
        assert await runner.run(settle) is True
    assert await _told(client, stream) == [job_id]  # a job of no batch tells nobody


def _batch(batch_id: str, total: int = 3) -> BatchRecord:
    return BatchRecord(
        id=batch_id,
        endpoint="/v1/completions",
        input_file_id="file-" + "0" * 32,
        completion_window="24h",
        status="in_progress",
        created_at=1.0,
        expires_at=2.0,
        total=total,
        chunks=[total],
        output_ttl_s=60,
        owner=ANONYMOUS,
    )


async def test_each_lines_result_is_written_once(client: aioredis.Redis) -> None:
    keys, tx, runner = _keys(client), BatchTransitions(_keys(client)), ScriptRunner(client)
    batch_id = new_batch_id()
    await client.hset(keys.batch(batch_id), mapping=_batch(batch_id).to_hash())
    ok = LineResult(1, "out", '{"a": 1}', input_tokens=2, output_tokens=3, cached_tokens=1)
    written = await runner.run(tx.results(batch_id, [ok, ok], ttl_s=60))
    assert (written.written, written.completed, written.failed) == (1, 1, 0)
    late = LineResult(1, "err", '{"b": 2}')  # the same line failing after it succeeded
    other = LineResult(2, "err", '{"c": 3}')
    written = await runner.run(tx.results(batch_id, [late, other], ttl_s=60))
    assert (written.written, written.completed, written.failed) == (1, 1, 1)
    assert await client.hgetall(keys.batch_results(batch_id, "out")) == {"1": '{"a": 1}'}
    assert await client.hgetall(keys.batch_results(batch_id, "err")) == {"2": '{"c": 3}'}
    record = BatchRecord.from_hash(await client.hgetall(keys.batch(batch_id)))
    assert (record.input_tokens, record.output_tokens, record.cached_tokens) == (2, 3, 1)


async def test_an_ended_batch_takes_no_more_results(client: aioredis.Redis) -> None:
    keys, tx, runner = _keys(client), BatchTransitions(_keys(client)), ScriptRunner(client)
    batch_id = new_batch_id()
    ended = _batch(batch_id).model_copy(update={"status": "completed"})
    await client.hset(keys.batch(batch_id), mapping=ended.to_hash())
    written = await runner.run(tx.results(batch_id, [LineResult(3, "out", "{}")], ttl_s=60))
    assert written.written == 0
    assert await client.exists(keys.batch_results(batch_id, "out")) == 0


async def test_status_changes_are_compare_and_sets_under_the_lease(client: aioredis.Redis) -> None:
    keys, tx, runner = _keys(client), BatchTransitions(_keys(client)), ScriptRunner(client)
    batch_id = new_batch_id()
    await client.hset(keys.batch(batch_id), mapping=_batch(batch_id).to_hash())
    assert await runner.run(tx.hold(batch_id, token="a", ttl_ms=5000)) is True
    assert await runner.run(tx.hold(batch_id, token="b", ttl_ms=5000)) is False
    fields = BatchRecord.fields(status="finalizing")
    stolen = tx.update(batch_id, statuses=["in_progress"], fields=fields, lease_token="b")
    assert (await runner.run(stolen)).status == "lease"
    mine = tx.update(batch_id, statuses=["in_progress"], fields=fields, lease_token="a")
    assert (await runner.run(mine)).done
    cancel = BatchRecord.fields(status="cancelling")
    late = tx.update(batch_id, statuses=["validating", "in_progress"], fields=cancel)
    assert await runner.run(late) == Updated(False, "finalizing")
    assert await client.hget(keys.batch(batch_id), "status") == "finalizing"
    assert await runner.run(tx.free(batch_id, token="b")) is False
    assert await runner.run(tx.free(batch_id, token="a")) is True
    assert await runner.run(tx.hold(batch_id, token="b", ttl_ms=5000)) is True


def test_records_round_trip_and_ids_are_stable() -> None:
    batch = _batch(new_batch_id()).model_copy(
        update={"errors": [BatchError(code="c", message="m", line=3)], "metadata": {"k": "v"}}
    )
    assert BatchRecord.from_hash(batch.to_hash()) == batch
    assert batch.view().request_counts.total == 3
    f = FileRecord(
        id="file-" + "1" * 32,
        filename="in.jsonl",
        purpose="batch",
        bytes=10,
        created_at=1.0,
        expires_at=2.0,
        lines=2,
        chunks=[1, 1],
        owner="o" * 32,
    )
    assert FileRecord.from_hash(f.to_hash()) == f
    assert batch_job_id(batch.id, 7) == batch_job_id(batch.id, 7) != batch_job_id(batch.id, 8)
    assert result_file_id(batch.id, "out") != result_file_id(batch.id, "err")


@pytest.mark.parametrize(
    ("window", "seconds"), [("24h", 86_400), ("90m", 5400), ("2s", 2), ("1h", 3600)]
)
def test_completion_windows(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["25h", "0s", "1d", "h", "10", " 1h"])
def test_bad_completion_windows_are_refused(window: str) -> None:
    with pytest.raises(ValueError, match="completion_window"):
        window_seconds(window)
