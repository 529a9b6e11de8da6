"""OpenAI-compatible endpoints: POST /v1/completions and POST /v1/chat/completions.

Thin: the body is validated by its protocol type (a bad field is a 422 in OpenAI's error shape,
naming it), the work is OpenAIServing's. GET /v1/models lives in gateway/routes/models.py.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response

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
