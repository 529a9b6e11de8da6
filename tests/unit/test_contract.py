"""The wire contract in shared/: each Redis value has one model and one codec that round-trips
it, and the Lua scripts agree with those models (they name only fields the models have, and
build no event of their own)."""

from __future__ import annotations

import re
import typing
from importlib import resources

import fakeredis
import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from shared import events
from shared.batches import BatchRecord, BatchStatus
from shared.events import EVENT_FIELD, CancelledEvent, ErrorEvent, EventError, TokenEvent
from shared.keys import Keys
from shared.quotas import Admission, QuotaCalls
from shared.records import (
    ANONYMOUS,
    ControlMessage,
    DeadLetter,
    Heartbeat,
    IdempotencyClaim,
    JobRecord,
    QueueEntry,
    RecordError,
)
from shared.schemas import ErrorInfo, JobResult, JobSpec, JobStatus, Sampling, Usage
from shared.transitions import (
    Call,
    NotStartable,
    ScriptRunner,
    Started,
    SubmitReply,
    Transitions,
    Written,
)
from tests.conftest import REDIS_URL, test_prefix

JOB = "0123456789abcdef" * 2


def _spec(job_id: str = JOB) -> JobSpec:
    return JobSpec(
        id=job_id,
        model="m",
        input_ids=[1, 2, 3],
        max_tokens=4,
        sampling=Sampling(stop=["x"], seed=7),
        priority="batch",
        created_at=1700000000.25,
        deadline=1700000060.5,
    )


_SCRIPTS_OF_NO_JOB = {"rate_limit.lua"}
"""Scripts whose KEYS[1] is not a job record (a request token bucket)."""


def _lua_sources() -> dict[str, str]:
    lua = resources.files("shared") / "lua"
    return {p.name: p.read_text() for p in lua.iterdir() if p.name.endswith(".lua")}


def test_a_job_record_round_trips_through_its_hash() -> None:
    record = JobRecord(
        spec=_spec(),
        status="succeeded",
        attempt=2,
        worker="w-1",
        started_at=1.5,
        finished_at=2.75,
        result=JobResult(text="héllo", token_ids=[5, 6], finish_reason="stop"),
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
        error=ErrorInfo(code="c", message="m"),
        metadata={"nested": {"a": [1, 2]}},
        fingerprint="f" * 64,
        owner="0" * 32,
    )
    stored = record.to_hash()
    assert all(isinstance(v, str) for v in stored.values())
    assert stored["status"] == "succeeded" and stored["attempt"] == "2"  # what Lua compares
    assert JobRecord.from_hash(stored) == record
    assert JobRecord.from_hash({k.encode(): v.encode() for k, v in stored.items()}) == record


def test_every_writer_names_the_owner_and_old_records_still_read() -> None:
    """The owner has no default: a record built without one is refused (mypy refuses the
    call too); a hash written before owners were (no `owner` field) reads as owner None."""
    with pytest.raises(ValidationError, match="owner"):
        JobRecord(spec=_spec(), status="queued")  # type: ignore[call-arg]
    stored = JobRecord(spec=_spec(), status="queued", owner=None).to_hash()
    assert "owner" not in stored
    assert JobRecord.from_hash(stored).owner is None


def test_a_partial_update_is_validated_as_its_fields() -> None:
    fields = JobRecord.fields(status="expired", finished_at=3.0)
    assert fields == {"status": "expired", "finished_at": "3.0"}
    with pytest.raises(ValueError):
        JobRecord.fields(status="exploded")
    with pytest.raises(KeyError):
        JobRecord.fields(first_token_at=1.0)
    # a model field: a dict is validated, a model built already is taken as it is
    with pytest.raises(ValueError):
        JobRecord.fields(usage={"prompt_tokens": "many"})
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    assert JobRecord.fields(usage=usage) == {"usage": usage.model_dump_json()}
    assert JobRecord.fields(usage=usage.model_dump()) == {"usage": usage.model_dump_json()}


def test_json_fields_read_what_json_dumps_wrote() -> None:
    """JSON fields are read by msgspec, and by `json.loads` where msgspec refuses what
    `json.dumps` writes (NaN, Infinity); a field that is no JSON at all names the reason."""
    stored = JobRecord(spec=_spec(), status="queued", owner=ANONYMOUS).to_hash()
    stored["metadata"] = '{"score": NaN, "big": Infinity, "n": [1, 2.5, "x", null, true]}'
    metadata = JobRecord.from_hash(stored).metadata
    assert metadata["score"] != metadata["score"] and metadata["big"] == float("inf")
    assert metadata["n"] == [1, 2.5, "x", None, True]
    stored["metadata"] = "{not json"
    with pytest.raises(RecordError, match="not JSON"):
        JobRecord.from_hash(stored)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"tokens": "3"}, "job"),
        ({"job": "zz", "tokens": "3"}, "job"),
        ({"job": JOB + "\n", "tokens": "3"}, "job"),
        ({"job": JOB, "tokens": "many"}, "tokens"),
        ({b"job": b"\x80\x03cos\nsystem"}, "UTF-8"),
    ],
)
def test_a_malformed_queue_entry_is_an_error_naming_why(
    raw: dict[str, str] | dict[bytes, bytes], reason: str
) -> None:
    with pytest.raises(RecordError, match=reason):
        QueueEntry.from_hash(raw)


def test_every_other_value_round_trips() -> None:
    entry = QueueEntry(job=JOB, tokens=9, owner="anonymous")
    assert QueueEntry.from_hash(entry.to_hash()) == entry
    assert QueueEntry.from_hash({"job": JOB, "tokens": "9"}).owner is None  # written before
    beat = Heartbeat(
        worker_id="w",
        model="m",
        engine="sim",
        host="h",
        pid=1,
        version="0",
        capacity=4,
        active=1,
        tokens_per_s=2.5,
        started_at=1.0,
        draining=True,
    )
    assert Heartbeat.from_hash(beat.to_hash()) == beat
    letter = DeadLetter(queue="q", entry="1-0", reason="bad", at=1.0)
    assert DeadLetter.from_hash(letter.to_hash()) == letter
    msg = ControlMessage(cancel=JOB, attempt=3, reason="client disconnected")
    assert ControlMessage.decode(msg.encode()) == msg
    claim = IdempotencyClaim(job=JOB, fingerprint="f")
    assert IdempotencyClaim.decode(claim.encode()) == claim
    with pytest.raises(RecordError):
        ControlMessage.decode('{"cancel": 1, "extra": true}')


def test_events_round_trip_and_peek() -> None:
    ev = TokenEvent(seq=4, attempt=2, text="a", token_ids=[1], count=1)
    data = events.encode(ev)
    assert events.decode(data) == ev
    assert events.peek(data) == (4, "token")
    for bad in ("{", '{"seq": 1}', '{"seq": 1, "type": "nope"}'):
        with pytest.raises(EventError):
            events.decode(bad)


def test_the_lua_scripts_build_no_events_and_name_only_record_fields() -> None:
    """The record's field names and status values the scripts use are the model's own (a
    job's; a batch's for the batch_* scripts)."""
    sources = _lua_sources()
    jobs = set(JobRecord.model_fields) | set(typing.get_args(JobStatus))
    batches = set(BatchRecord.model_fields) | set(typing.get_args(BatchStatus))
    record_call = re.compile(r"'(?:HGET|HSET|HSETNX|HMGET|HINCRBY|HDEL)', KEYS\[1\], ([^)]*)")
    for name, source in sources.items():
        assert "cjson" not in source, f"{name} builds JSON itself"
        if name in _SCRIPTS_OF_NO_JOB:
            continue
        known, model = (
            (batches, "BatchRecord") if name.startswith("batch_") else (jobs, "JobRecord")
        )
        for call in record_call.finditer(source):
            named = set(re.findall(r"'([a-z_]+)'", call.group(1)))
            assert named <= known, f"{name}: {named - known} not in {model}"
        for field in re.findall(r"'0-' \.\. [^,]+, '([a-z]+)'", source):
            assert field == EVENT_FIELD


@pytest.fixture(params=["redis", "fakeredis"])
async def client(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if request.param == "redis":
        c = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    else:
        c = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    yield c
    await c.aclose()


def _submit(tx: Transitions) -> Call[SubmitReply]:
    """SUBMIT of job JOB (model m, batch), no idempotency key, no limits."""
    record = JobRecord(spec=_spec(), status="queued", fingerprint="f", owner=ANONYMOUS)
    queued = events.encode(
        events.QueuedEvent(seq=1, id=JOB, model="m", priority="batch", prompt_tokens=3)
    )
    return tx.submit(
        record,
        queued_event=queued,
        entry=QueueEntry(job=JOB, tokens=7),
        idempotency_key=None,
        idempotency_claim="",
        idempotency_ttl_s=60,
        admission=Admission(tokens=7, check_at=1.0),
    )


async def test_scripts_forgotten_by_redis_are_loaded_again(client: aioredis.Redis) -> None:
    """A Redis restarted between two calls answers NOSCRIPT: the runner reloads and re-sends."""
    keys = Keys(test_prefix())
    tx, runner = Transitions(keys), ScriptRunner(client)
    try:
        submit = _submit(tx)
        await client.script_flush()
        await runner.run(submit)
        await client.script_flush()
        [started] = await runner.run_all(
            [tx.start(JOB, worker="w", now=2.0, max_attempts=3, max_interruptions=5)]
        )
        assert isinstance(started, Started) and started.attempt == 1 and started.last_seq == 1
        await client.script_flush()
        token = events.encode(TokenEvent(seq=2, attempt=1, text="t", token_ids=[1], count=1))
        end = JobRecord.fields(status="failed", error=ErrorInfo(code="x", message="y"))
        emit = tx.emit(JOB, worker="w", attempt=1, events=[(2, token)], maxlen=100, fields=end)
        assert await runner.run_all([emit]) == [Written(cancel=None)]
        stored = JobRecord.from_hash(await client.hgetall(keys.job(JOB)))
        assert stored.status == "failed" and stored.error == ErrorInfo(code="x", message="y")
        again = await runner.run(
            tx.start(JOB, worker="w", now=3.0, max_attempts=3, max_interruptions=5)
        )
        assert again == NotStartable("failed")
    finally:
        await client.delete(
            keys.job(JOB),
            keys.events(JOB),
            keys.queue("m", "batch"),
            *QuotaCalls(keys).counter_keys(),
        )


async def test_a_submit_sent_again_after_its_reply_was_lost_queues_the_job_once(
    client: aioredis.Redis,
) -> None:
    """redis-py re-sends a command whose connection dropped before the reply: the second
    SUBMIT of one job answers `queued` (the old script failed on its first event's XADD, after
    the record was written: the gateway answered an error for a job it had queued)."""
    keys = Keys(test_prefix())
    tx, runner = Transitions(keys), ScriptRunner(client)
    submit = _submit(tx)
    try:
        first = await runner.run(submit)
        again = await runner.run(submit)
        assert again == first
        assert await client.xlen(keys.queue("m", "batch")) == 1
        assert await client.xlen(keys.events(JOB)) == 1
    finally:
        await client.delete(
            keys.job(JOB),
            keys.events(JOB),
            keys.queue("m", "batch"),
            *QuotaCalls(keys).counter_keys(),
        )


async def test_settle_is_a_compare_and_set(client: aioredis.Redis) -> None:
    keys = Keys(test_prefix())
    tx, runner = Transitions(keys), ScriptRunner(client)
    await client.hset(
        keys.job(JOB), mapping=JobRecord(spec=_spec(), status="queued", owner=ANONYMOUS).to_hash()
    )
    await client.xadd(keys.events(JOB), {EVENT_FIELD: "{}"}, id="0-1")
    try:
        cancelled = events.encode(CancelledEvent(seq=2, attempt=0))
        settle = tx.settle(
            JOB,
            status="queued",
            attempt=0,
            last_seq=1,
            event=(2, cancelled),
            fields=JobRecord.fields(status="cancelled"),
            maxlen=100,
            retention_s=60,
        )
        stale = tx.settle(
            JOB,
            status="queued",
            attempt=0,
            last_seq=1,
            event=(2, events.encode(ErrorEvent(seq=2, code="c", message="m"))),
            fields=JobRecord.fields(status="expired"),
            maxlen=100,
            retention_s=60,
        )
        assert await runner.run(settle) is True
        assert await runner.run(stale) is False  # the job changed: nothing written
        assert await client.hget(keys.job(JOB), "status") == "cancelled"
        assert await client.xlen(keys.events(JOB)) == 2
        assert 0 < await client.ttl(keys.job(JOB)) <= 60
    finally:
        await client.delete(keys.job(JOB), keys.events(JOB))
