"""OpenAI-compatible endpoints: POST /v1/completions, POST /v1/chat/completions and the
Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel).

Thin: the body is validated by its protocol type (a bad field is a 422 in OpenAI's error shape,
naming it), the work is OpenAIServing's. GET /v1/models lives in gateway/routes/models.py.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response

from gateway.body_scan import CountedListsRoute
from gateway.deps import Authorized, Caller, RateLimited, State
from gateway.http_errors import error_responses, sse_response
from gateway.job_service import IDEMPOTENCY_KEY_PATTERN
from gateway.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from gateway.openai.responses import ResponsesRequest, ResponsesServing
from gateway.openai.serving import OpenAIServing

router = APIRouter(
    prefix="/v1",
    tags=["openai"],
    dependencies=[Authorized, RateLimited],
    responses=error_responses(400, 401, 404, 409, 413, 422, 429, 503),
    route_class=CountedListsRoute,
)
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="the same key and body again: the same jobs, from their start",
    ),
]


def get_serving(state: State) -> OpenAIServing:
    return OpenAIServing(state)


Serving = Annotated[OpenAIServing, Depends(get_serving)]


@router.post(
    "/completions",
    response_model=None,
    responses={200: sse_response("The completion; with `stream`, SSE chunks", CompletionResponse)},
)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    serving: Serving,
    caller: Caller,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    return await serving.completions(body, request, caller, idempotency_key)


@router.post(
    "/chat/completions",
    response_model=None,
    responses={
        200: sse_response("The chat completion; with `stream`, SSE chunks", ChatCompletionResponse)
    },
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    serving: Serving,
    caller: Caller,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    return await serving.chat(body, request, caller, idempotency_key)


def get_responses(state: State) -> ResponsesServing:
    return ResponsesServing(state)


Responses = Annotated[ResponsesServing, Depends(get_responses)]


@router.post(
    "/responses",
    response_model=None,
    responses={200: sse_response("The response; with `stream`, its events as SSE")},
)
async def create_response(
    body: ResponsesRequest,
    request: Request,
    responses: Responses,
    caller: Caller,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """OpenAI's Responses API: one chat job. With `background`, the answer comes at once
    (`queued`) and the job runs whatever the client does; poll or stream it with GET."""
    return await responses.create(body, request, caller, idempotency_key)


@router.get(
    "/responses/{response_id}",
    response_model=None,
    responses={200: sse_response("The response; with `stream=true`, its events as SSE")},
)
async def retrieve_response(
    response_id: str,
    responses: Responses,
    caller: Caller,
    stream: bool = False,
    starting_after: Annotated[
        int | None, Query(ge=-1, description="with stream: the events after this sequence_number")
    ] = None,
) -> Response:
    return await responses.retrieve(response_id, caller, stream, starting_after)


@router.post("/responses/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, responses: Responses, caller: Caller) -> Response:
    """Cancel a queued or running response; the answer is the response once it has stopped
    (or, past two seconds, while its worker stops it)."""
    return await responses.cancel(response_id, caller)


@router.delete("/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, responses: Responses, caller: Caller) -> Response:
    return await responses.delete(response_id, caller)
