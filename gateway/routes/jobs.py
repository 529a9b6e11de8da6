"""Native job API: submit, inspect, follow (SSE, resumable), cancel."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway.body_scan import CountedListsRoute
from gateway.deps import Authorized, Caller, RateLimited, State
from gateway.http_errors import error_responses, sse_response
from gateway.identity import Identity
from gateway.job_service import IDEMPOTENCY_KEY_PATTERN, check_idempotency_key
from gateway.pubsub import Subscription
from gateway.state import GatewayState
from gateway.streaming import (
    STOPPED_REASON,
    EventFollower,
    EventStreamResponse,
    sse_stream,
    stopped_frame,
)
from shared import events
from shared.errors import BadRequest, GenqError, Unavailable
from shared.events import FINAL_EVENT_TYPES, EventError
from shared.keys import MAX_SEQ
from shared.schemas import JobCreate, JobView

router = APIRouter(
    prefix="/v1/jobs",
    tags=["jobs"],
    dependencies=[Authorized, RateLimited],
    responses=error_responses(401, 404, 422, 429, 503),
    route_class=CountedListsRoute,
)

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="the same key and body again: the same job (200, Idempotent-Replayed)",
    ),
]
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID")]
_SEQ = re.compile(r"[0-9]{1,20}")


@router.post(
    "",
    status_code=202,
    response_model=JobView,
    responses={
        200: sse_response(
            "With `stream`: the job's SSE stream; with a replayed Idempotency-Key: the earlier job",
            JobView,
        ),
        **error_responses(400, 409, 413, 429),
    },
)
async def create_job(
    body: JobCreate, state: State, caller: Caller, idempotency_key: IdempotencyKey = None
) -> JSONResponse | EventStreamResponse:
    """Queue a job. With `"stream": true` the answer is the job's SSE stream."""
    if state.draining:
        raise Unavailable("this gateway is shutting down; retry on another")
    if idempotency_key is None:  # a replay is answered whatever the limits say now
        await state.admission.precheck(caller, body.model, body.priority, 1)
    else:
        check_idempotency_key(idempotency_key)
        await state.admission.check_memory()
    if not body.stream:
        submitted = await state.jobs.submit(body, idempotency_key, caller=caller)
        headers = {"Idempotent-Replayed": "true"} if submitted.replayed else {}
        return JSONResponse(
            submitted.job.model_dump(mode="json"),
            status_code=200 if submitted.replayed else 202,
            headers=headers,
        )
    spec = await state.jobs.prepare(body)  # reject bad input before subscribing
    sub = await state.router.subscribe(state.keys.channel(spec.id))
    try:
        submitted = await state.jobs.submit(body, idempotency_key, spec, caller=caller)
    except BaseException:
        await sub.close()
        raise
    job_id = submitted.job.id
    if submitted.replayed:  # the stream of the earlier job, from its start
        await sub.close()
        sub = await state.router.subscribe(state.keys.channel(job_id))
    follower = EventFollower(
        state.redis, state.keys, state.settings, sub, job_id, ended=state.jobs.placement.ended
    )
    mortal = body.cancel_on_disconnect
    stream = stream_job(state, follower, caller, cancel_on_disconnect=mortal)
    return _response(state, stream, follower, resumes=not mortal)


@router.get("/{job_id}", response_model=JobView)
async def get_job(job_id: str, state: State, caller: Caller) -> JobView:
    return await state.jobs.get(job_id, caller)


@router.get(
    "/{job_id}/events",
    response_class=EventStreamResponse,
    status_code=200,  # FastAPI reads it from the class otherwise, and this one takes none
    responses={200: sse_response("The job's events as SSE"), **error_responses(400)},
)
async def job_events(
    job_id: str,
    state: State,
    caller: Caller,
    last_event_id: LastEventId = None,
    after: Annotated[
        str | None, Query(description="resume after this seq (a non-negative integer)")
    ] = None,
) -> EventStreamResponse:
    """The job's events: its log replayed, then live; it ends after the job's last event.
    Resume with `Last-Event-ID` (or `?after=`): only what follows that seq is sent, and a
    resume at or past a finished job's last event ends at once. Resuming here keeps the job
    running if the gateway that streamed it with cancel-on-disconnect dies."""
    await state.jobs.get(job_id, caller, text_so_far=False)  # 404 before any stream starts
    after_seq = max(
        _seq(after, "after") if after is not None else 0,
        _seq(last_event_id, "Last-Event-ID") if last_event_id else 0,
    )
    await state.presence.mark_resumed(job_id)
    sub = await state.router.subscribe(state.keys.channel(job_id))
    follower = EventFollower(state.redis, state.keys, state.settings, sub, job_id, after_seq)
    stream = stream_job(state, follower, caller, cancel_on_disconnect=False)
    return _response(state, stream, follower, resumes=True)


@router.delete("/{job_id}", response_model=JobView, responses=error_responses(409))
async def cancel_job(job_id: str, state: State, caller: Caller) -> JobView:
    """Cancel a queued job (at once) or a running one: the answer is the job after the
    request. A running job's worker gets up to `GENQ_CANCEL_WAIT_S` to stop it; if it has
    not, the answer is `running` with `cancel_requested: true` (it ends `cancelled` soon)."""
    sub = await state.router.subscribe(state.keys.channel(state.jobs.validate_id(job_id)))
    try:
        view = await state.jobs.cancel(job_id, caller)
        if view.status == "running":
            await _until_final(sub, state.settings.cancel_wait_s)
            view = await state.jobs.get(job_id, caller)
    finally:
        await sub.close()
    return view


async def _until_final(sub: Subscription, wait_s: float) -> None:
    """Until the job's final event goes by on its channel, or `wait_s` passes."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_s):
            while True:
                await sub.wake.wait()
                if sub.behind or any(_is_final(data) for data in sub.take()):
                    return


def _is_final(data: str) -> bool:
    try:
        return events.peek(data)[1] in FINAL_EVENT_TYPES
    except EventError:
        return False


def _seq(value: str, param: str) -> int:
    """An event seq as a client sends it back: plain decimal digits, within a stream id's
    range (int() alone would take `1_0`, ` 1`, `+1`)."""
    if not _SEQ.fullmatch(value) or int(value) > MAX_SEQ:
        raise BadRequest(
            f"{param} must be the seq of an event: an integer from 0 to {MAX_SEQ}", param=param
        )
    return int(value)


def _response(
    state: GatewayState, stream: AsyncIterator[bytes], follower: EventFollower, *, resumes: bool
) -> EventStreamResponse:
    """The job's SSE response; if the gateway stops before the job ends, its last event is
    the `server_stopping` error (`resumes`: the job goes on; else its stream's end cancels
    it)."""
    return EventStreamResponse(
        stream,
        follower.job_id,
        stall_timeout_s=state.settings.stream_stall_timeout_s,
        on_stop=functools.partial(stopped_frame, follower, resumes),
    )


async def stream_job(
    state: GatewayState, follower: EventFollower, caller: Identity, *, cancel_on_disconnect: bool
) -> AsyncIterator[bytes]:
    """SSE bytes of one job; on a disconnect before the end, optionally cancel the job (and
    while it streams, the job dies with this gateway: `gateway.presence`)."""
    job_ids = [follower.job_id] if cancel_on_disconnect else []
    try:
        await state.presence.register(job_ids)
        async for chunk in sse_stream(follower):
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await follower.sub.close()
            with contextlib.suppress(GenqError, RedisError, OSError):
                if cancel_on_disconnect and not follower.finished:
                    why = STOPPED_REASON if state.stopping.ending_streams else "client disconnected"
                    await state.jobs.cancel(follower.job_id, caller, why)
                await state.presence.unregister(job_ids)
