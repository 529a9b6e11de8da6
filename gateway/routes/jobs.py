"""Native job API: submit, inspect, follow (SSE, resumable), cancel."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway.deps import Authorized, State
from gateway.http_errors import error_responses, sse_response
from gateway.state import GatewayState
from gateway.streaming import EventFollower, EventStreamResponse, sse_stream
from shared.errors import BadRequest, GenqError, Unavailable
from shared.schemas import JobCreate, JobView

router = APIRouter(
    prefix="/v1/jobs",
    tags=["jobs"],
    dependencies=[Authorized],
    responses=error_responses(401, 404, 422, 503),
)

IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID")]


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
    body: JobCreate, state: State, idempotency_key: IdempotencyKey = None
) -> JSONResponse | EventStreamResponse:
    """Queue a job. With `"stream": true` the answer is the job's SSE stream."""
    if state.draining:
        raise Unavailable("this gateway is shutting down; retry on another")
    if not body.stream:
        submitted = await state.jobs.submit(body, idempotency_key)
        headers = {"Idempotent-Replayed": "true"} if submitted.replayed else {}
        return JSONResponse(
            submitted.job.model_dump(mode="json"),
            status_code=200 if submitted.replayed else 202,
            headers=headers,
        )
    spec = await state.jobs.prepare(body)  # reject bad input before subscribing
    sub = await state.router.subscribe(state.keys.channel(spec.id))
    try:
        submitted = await state.jobs.submit(body, idempotency_key, spec)
    except BaseException:
        await sub.close()
        raise
    job_id = submitted.job.id
    if submitted.replayed:  # the stream of the earlier job, from its start
        await sub.close()
        sub = await state.router.subscribe(state.keys.channel(job_id))
    follower = EventFollower(state.redis, state.keys, state.settings, sub, job_id)
    stream = stream_job(state, follower, cancel_on_disconnect=body.cancel_on_disconnect)
    return EventStreamResponse(stream, job_id)


@router.get("/{job_id}", response_model=JobView)
async def get_job(job_id: str, state: State) -> JobView:
    return await state.jobs.get(job_id)


@router.get(
    "/{job_id}/events",
    response_class=EventStreamResponse,
    status_code=200,  # FastAPI reads it from the class otherwise, and this one takes none
    responses={200: sse_response("The job's events as SSE"), **error_responses(400)},
)
async def job_events(
    job_id: str,
    state: State,
    last_event_id: LastEventId = None,
    after: Annotated[int | None, Query(ge=0, description="resume after this seq")] = None,
) -> EventStreamResponse:
    """The job's events: its log replayed, then live. Resume with `Last-Event-ID`."""
    await state.jobs.get(job_id)  # 404 before any stream starts
    after_seq = after or 0
    if last_event_id:
        try:
            after_seq = max(after_seq, int(last_event_id))
        except ValueError:
            raise BadRequest(
                "Last-Event-ID must be the integer seq of an event", param="Last-Event-ID"
            ) from None
    sub = await state.router.subscribe(state.keys.channel(job_id))
    follower = EventFollower(state.redis, state.keys, state.settings, sub, job_id, after_seq)
    return EventStreamResponse(stream_job(state, follower, cancel_on_disconnect=False), job_id)


@router.delete("/{job_id}", response_model=JobView, responses=error_responses(409))
async def cancel_job(job_id: str, state: State) -> JobView:
    return await state.jobs.cancel(job_id)


async def stream_job(
    state: GatewayState, follower: EventFollower, *, cancel_on_disconnect: bool
) -> AsyncIterator[bytes]:
    """SSE bytes of one job; on a disconnect before the end, optionally cancel the job."""
    try:
        async for chunk in sse_stream(follower):
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await follower.sub.close()
            if cancel_on_disconnect and not follower.finished:
                with contextlib.suppress(GenqError, RedisError, OSError):
                    await state.jobs.cancel(follower.job_id, "client disconnected")
