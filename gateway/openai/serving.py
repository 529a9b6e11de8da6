"""OpenAI requests as genq jobs.

Every choice of every prompt is one interactive-priority job, queued through JobService like a
native one (so it shows at /v1/jobs/{id}: the response id is `chatcmpl-<id of job 0>`, and the
`X-Job-Ids` header lists all of them). Phases of a request:

  plan     what no model could run: parameters genq cannot honour, empty prompts (400)
  admit    the model is known (404), some live worker serves it (503), its queue has room (429)
  prepare  build each job (chat: render the template) and validate it; nothing is written yet
  start    subscribe each job's channel, then queue it
  output   follow every job's events: SSE chunks, or one response when all have ended

A client that goes away, streaming or not, cancels its unfinished jobs (queued or running) when
`openai_cancel_on_disconnect` is on.

`plan` and `prepare_jobs` are the whole validation of a request body: the batch API
(gateway/batch) runs every line of an input file through the same two, so a batch line is
refused exactly where the live endpoint would refuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError

from gateway.openai.merge import Batch, disconnected, merged, stop_tasks
from gateway.openai.output import (
    ChatFormat,
    ChoiceState,
    CompletionFormat,
    OutputFormat,
    RequestState,
)
from gateway.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    SamplingParams,
)
from gateway.openai.templates import render_chat
from gateway.registry import LoadedCard
from gateway.state import GatewayState
from gateway.streaming import KEEPALIVE, EventFollower, EventStreamResponse
from shared import events
from shared.errors import (
    BadRequest,
    Conflict,
    GenqError,
    TooManyRequests,
    Unavailable,
    Unprocessable,
)
from shared.events import TokenEvent
from shared.keys import Priority
from shared.schemas import MAX_SEED, JobCreate, JobSpec
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""Status of a response nobody will read: its client disconnected (nginx's convention)."""
DONE_FRAME = b"data: [DONE]\n\n"
_OUTPUT_EVENTS = frozenset({"token", "done", "error", "cancelled"})

Prompt = str | list[int]
OpenAIBody = CompletionRequest | ChatCompletionRequest


# ---- plan and prepare: the validation the live endpoints and the batch API share ----------


@dataclass(frozen=True, slots=True)
class Plan:
    """A request body checked as far as it can be without its model's card."""

    kind: Literal["cmpl", "chatcmpl"]
    req: OpenAIBody
    prompts: list[Prompt]
    """Completions: the prompts. Chat: none yet (its one prompt is rendered from the card)."""
    max_tokens: int | None
    logprobs: int | None

    @property
    def jobs(self) -> int:
        """Jobs the request starts: n per prompt."""
        return max(len(self.prompts), 1) * self.req.n

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chatcmpl" else "prompt"

    @property
    def want_logprobs(self) -> bool:
        if isinstance(self.req, ChatCompletionRequest):
            return bool(self.req.logprobs)
        return self.req.logprobs is not None

    def output_format(self) -> OutputFormat:
        if isinstance(self.req, ChatCompletionRequest):
            return ChatFormat(self.want_logprobs)
        return CompletionFormat(self.want_logprobs)


def plan(req: OpenAIBody) -> Plan:
    """Refuse what no model could run: parameters genq cannot honour, empty prompts (400)."""
    _refuse_unsupported(req)
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return Plan("chatcmpl", req, [], req.completion_limit, logprobs)
    return Plan("cmpl", req, _completion_prompts(req), req.max_tokens, req.logprobs)


async def prepare_jobs(
    state: GatewayState, p: Plan, loaded: LoadedCard, priority: Priority
) -> tuple[RequestState, list[tuple[JobCreate, JobSpec]]]:
    """Render (chat), validate and tokenize every prompt once against the model's card (400
    for a prompt that cannot run: too long, a template that refuses it); one job per
    (prompt, choice). Nothing is written yet."""
    req = p.req
    prompts = p.prompts
    if isinstance(req, ChatCompletionRequest):
        prompts = [_render(state.settings, loaded, req)]
    request_id = uuid.uuid4().hex
    run = RequestState(f"{p.kind}-{request_id}", int(time.time()), req.model, [], [])
    jobs: list[tuple[JobCreate, JobSpec]] = []
    for i, prompt in enumerate(prompts):
        body = _job_body(req, prompt, p.max_tokens, p.logprobs, p.prompt_param, priority)
        spec = await state.jobs.prepare(body)
        run.prompt_tokens.append(len(spec.input_ids))
        for j in range(req.n):
            index = len(jobs)
            job_id = request_id if index == 0 else uuid.uuid4().hex
            seed = None if req.seed is None else (req.seed + j) % (MAX_SEED + 1)
            meta = _metadata(p.kind, run.id, index, req.user)
            jobs.append(
                (
                    body.model_copy(update={"seed": seed, "metadata": meta}),
                    spec.model_copy(
                        update={
                            "id": job_id,
                            "sampling": spec.sampling.model_copy(update={"seed": seed}),
                        }
                    ),
                )
            )
            run.choices.append(ChoiceState(index, job_id, i))
    return run, jobs


def _render(settings: GatewaySettings, loaded: LoadedCard, req: ChatCompletionRequest) -> str:
    card = loaded.card
    template = card.chat_template or settings.default_chat_template
    if template is None:
        raise BadRequest(
            f"model '{card.name}' has no chat template (and no GENQ_DEFAULT_CHAT_TEMPLATE is "
            "configured); use /v1/completions with a formatted prompt",
            param="messages",
            code="chat_template_missing",
        )
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    text = render_chat(
        template,
        messages,
        add_generation_prompt=req.add_generation_prompt,
        bos_token=card.bos_token,
        eos_token=card.eos_token,
    )
    if card.add_bos and card.bos_token and text.startswith(card.bos_token):
        text = text[len(card.bos_token) :]  # JobService adds the BOS token itself
    return text


# ---- the live endpoints -------------------------------------------------------------------


class OpenAIServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.settings = state.settings

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        return await self._serve(plan(req), request)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        return await self._serve(plan(req), request)

    async def _serve(self, p: Plan, request: Request) -> Response:
        loaded = await self._admit(p.req.model, p.jobs)
        run, jobs = await prepare_jobs(self.state, p, loaded, "interactive")
        return await self._respond(p.req, request, run, jobs, p.output_format())

    async def _admit(self, model: str, jobs: int) -> LoadedCard:
        s, state = self.settings, self.state
        if state.draining:
            raise Unavailable("this gateway is shutting down; retry on another")
        if jobs > s.openai_max_jobs:
            raise BadRequest(
                f"this request asks for {jobs} completions (n x prompts); the limit is "
                f"{s.openai_max_jobs}",
                param="n",
            )
        loaded = await state.registry.get(model)  # ModelNotFound (404) if never served
        beats = await state.registry.live_workers()
        if not any(b.model == loaded.card.name and not b.draining for b in beats):
            raise Unavailable(
                f"no live worker serves model '{model}' right now; retry later",
                param="model",
                code="model_unavailable",
            )
        if s.openai_max_queue_depth:
            depth = await state.redis.xlen(state.keys.queue(loaded.card.name, "interactive"))
            if depth >= s.openai_max_queue_depth:
                raise TooManyRequests(
                    f"model '{model}' has {depth} interactive jobs queued or running, the limit "
                    f"(GENQ_OPENAI_MAX_QUEUE_DEPTH) is {s.openai_max_queue_depth}; retry later",
                    code="queue_full",
                )
        return loaded

    # ---- start and output -----------------------------------------------------------------

    async def _respond(
        self,
        req: SamplingParams,
        request: Request,
        run: RequestState,
        jobs: list[tuple[JobCreate, JobSpec]],
        fmt: OutputFormat,
    ) -> Response:
        followers = await self._start(jobs)
        headers = {"X-Job-Ids": ",".join(c.job_id for c in run.choices)}
        if req.stream:
            stream = self._sse(run, followers, fmt, req.include_usage)
            response = EventStreamResponse(stream, run.choices[0].job_id)
            response.headers.update(headers)
            return response
        collect = asyncio.create_task(self._collect(run, followers))
        gone = asyncio.create_task(disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            with anyio.CancelScope(shield=True):
                await stop_tasks([collect, gone])
                await self._close(run, followers)
        if not collect.cancelled():
            collect.result()  # raises what collecting raised
            return JSONResponse(fmt.response(run).model_dump(mode="json"), headers=headers)
        log.info("client disconnected", extra={"job_id": run.choices[0].job_id})
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _start(self, jobs: list[tuple[JobCreate, JobSpec]]) -> list[EventFollower]:
        """Subscribe each job's channel, then queue the job; undo it all if one fails."""
        state = self.state
        followers: list[EventFollower] = []
        try:
            for body, spec in jobs:
                sub = await state.router.subscribe(state.keys.channel(spec.id))
                follower = EventFollower(state.redis, state.keys, state.settings, sub, spec.id)
                followers.append(follower)
                await state.jobs.submit(body, None, spec)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for f in followers:
                    await f.sub.close()
                    with contextlib.suppress(GenqError, RedisError, OSError):
                        await state.jobs.cancel(f.job_id, "request failed")
            raise
        return followers

    async def _collect(self, run: RequestState, followers: list[EventFollower]) -> None:
        """Follow every job to its end; raise the first failure as an error."""
        async for index, batch in merged(followers):
            if batch is not None:
                for ev in _output_events(batch):
                    run.choices[index].apply(ev)
        for c in run.choices:
            if c.failure is not None:
                cls = Conflict if c.failure.code == "cancelled" else GenqError
                raise cls(c.failure.message, code=c.failure.code)
            if not c.ended:
                raise GenqError(f"job {c.job_id} ended without a result", code="job_lost")

    async def _sse(
        self,
        run: RequestState,
        followers: list[EventFollower],
        fmt: OutputFormat,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """OpenAI's SSE: `data: {chunk}` frames, a usage chunk if asked, `data: [DONE]`."""
        try:
            yield b"".join(_frame(c) for c in fmt.opening(run))
            async for index, batch in merged(followers):
                if batch is None:
                    yield KEEPALIVE
                    continue
                choice, out = run.choices[index], []
                for ev in _output_events(batch):
                    choice.apply(ev)
                    if isinstance(ev, TokenEvent):
                        chunk = fmt.token_chunk(run, choice, ev)
                        out += [_frame(chunk)] if chunk is not None else []
                    elif choice.finish_reason is not None:
                        out.append(_frame(fmt.final_chunk(run, choice)))
                if out:
                    yield b"".join(out)
                if choice.failure is not None:
                    yield _frame(ErrorResponse(error=choice.failure)) + DONE_FRAME
                    return
            lost = next((c for c in run.choices if not c.ended), None)
            if lost is not None:
                detail = ErrorDetail(
                    message=f"job {lost.job_id} ended without a result",
                    type="server_error",
                    code="job_lost",
                )
                yield _frame(ErrorResponse(error=detail)) + DONE_FRAME
                return
            if include_usage:
                yield _frame(fmt.usage_chunk(run))
            yield DONE_FRAME
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(run, followers)

    async def _close(self, run: RequestState, followers: list[EventFollower]) -> None:
        """Unsubscribe; cancel the jobs nobody will read (the client left, or another failed)."""
        for f in followers:
            await f.sub.close()
        if not self.settings.openai_cancel_on_disconnect:
            return
        for c in run.choices:
            if not c.ended:
                with contextlib.suppress(GenqError, RedisError, OSError):
                    await self.state.jobs.cancel(c.job_id, "client disconnected")


# ---- helpers ------------------------------------------------------------------------------


def _output_events(batch: Batch) -> list[Any]:
    return [events.decode(data) for _, etype, data in batch if etype in _OUTPUT_EVENTS]


def _frame(chunk: BaseModel) -> bytes:
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


def _refuse_unsupported(req: SamplingParams) -> None:
    """A clear 400 for OpenAI parameters genq knows but cannot honour (not a silent drop)."""
    unsupported: dict[str, bool] = {"logit_bias": bool(req.logit_bias)}
    if isinstance(req, CompletionRequest):
        unsupported |= {
            "echo": req.echo,
            "best_of": req.best_of is not None and req.best_of != req.n,
            "suffix": bool(req.suffix),
        }
    if isinstance(req, ChatCompletionRequest):
        fmt = (req.response_format or {}).get("type", "text")
        unsupported |= {"tools": bool(req.tools), "response_format": fmt != "text"}
    for param, given in unsupported.items():
        if given:
            raise BadRequest(
                f"'{param}' is not supported by genq", param=param, code="unsupported_parameter"
            )


def _completion_prompts(req: CompletionRequest) -> list[Prompt]:
    p = req.prompt
    prompts: list[Prompt]
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [[x for x in p if isinstance(x, int)]]
    else:
        prompts = [x for x in p if isinstance(x, str | list)]
    if not prompts or any(len(x) == 0 for x in prompts):
        raise BadRequest("prompt is empty", param="prompt")
    return prompts


def _message_dict(index: int, m: ChatMessage) -> dict[str, Any]:
    """The message as templates expect it: content a string; absent fields absent."""
    out = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        bad = next((part.type for part in m.content if part.type != "text"), None)
        if bad is not None:
            raise BadRequest(
                f"content parts of type '{bad}' are not supported; only 'text'",
                param=f"messages.{index}.content",
            )
        out["content"] = "\n".join(part.text or "" for part in m.content)
    return out


def _job_body(
    req: SamplingParams,
    prompt: Prompt,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    priority: Priority,
) -> JobCreate:
    fields: dict[str, Any] = {
        "model": req.model,
        "max_tokens": max_tokens,
        "priority": priority,
        "stop": req.stop_list,
        "logprobs": logprobs,
    }
    fields["prompt" if isinstance(prompt, str) else "input_ids"] = prompt
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    try:
        return JobCreate(**fields)
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = [str(x) for x in e.get("loc", ())]
        param = prompt_param if loc and loc[0] in ("prompt", "input_ids") else ".".join(loc)
        raise Unprocessable(f"{param}: {e.get('msg', 'invalid')}", param=param) from None


def _metadata(kind: str, request_id: str, index: int, user: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"api": f"openai.{kind}", "request": request_id, "choice": index}
    if user is not None:
        meta["user"] = user
    return meta
