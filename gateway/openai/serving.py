"""OpenAI requests as genq jobs.

Every choice of every prompt is one job (interactive priority unless the request names
`priority`), queued through JobService like a native one (so it shows at /v1/jobs/{id}: the
response id is `chatcmpl-<id of job 0>`, and the `X-Job-Ids` header lists all of them).
Phases of a request:

  admit    the model is known (404), some live worker serves it (503), Redis has room (503),
           its queue and the key's quota have room (429)
  check    what no model could run: parameters genq cannot honour (400)
  prepare  build each job (chat: render the template) and validate it; nothing is written yet
  start    subscribe each job's channel, then queue it
  output   follow every job's events: SSE chunks, or one response when all have ended

A client that goes away, streaming or not, cancels its unfinished jobs (queued or running) when
`openai_cancel_on_disconnect` is on.

Idempotency-Key: job i of the request is submitted under the key's part i, with the request's
own fingerprint, so a request sent again with the key (or twenty at once) makes each job once
and follows the same jobs from their start: the same completion, the same stream. Such a
request is never cancelled by genq (not on disconnect, not when a later job of it is refused):
its key says the client will come back for it.

`plan`, `refuse` and `prepare_jobs` are the whole validation of a request body: the batch API
(gateway/batch) runs every line of an input file through the same three, so a batch line is
refused exactly where the live endpoint would refuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError

from gateway.admission import job_cost
from gateway.constraints import check_compatible
from gateway.http_errors import ErrorDetail
from gateway.identity import Identity
from gateway.job_service import check_idempotency_key
from gateway.keepalive import KEEPALIVE
from gateway.openai.merge import Batch, disconnected, merged, stop_tasks
from gateway.openai.output import (
    ChatFormat,
    ChoiceState,
    CompletionFormat,
    OutputFormat,
    RequestState,
)
from gateway.openai.protocol import (
    AS_IS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorResponse,
    SamplingParams,
)
from gateway.openai.structured import AskedSchema, response_schema
from gateway.openai.templates import render_chat
from gateway.openai.toolcalls import (
    FORMATS,
    MARKERS,
    TOOLS_ORIGIN,
    Tools,
    check_tools,
    family_of,
    grammar_for,
    template_message,
    template_tools,
)
from gateway.registry import LoadedCard
from gateway.state import GatewayState
from gateway.streaming import STOPPED_REASON, EventFollower, EventStreamResponse, sse_data
from shared import events
from shared.constraints import CONSTRAINT_KINDS, Constraint, SchemaCheck, json_options
from shared.errors import (
    BadRequest,
    Conflict,
    GenqError,
    Unavailable,
    Unprocessable,
    shown,
)
from shared.events import SERVER_STOPPING, TokenEvent
from shared.keys import Priority
from shared.schema_gaps import dotted, keyword_of
from shared.schemas import MAX_SEED, JobCreate, JobSpec, one_only

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""Status of a response nobody will read: its client disconnected (nginx's convention)."""
DONE_FRAME = b"data: [DONE]\n\n"
_OUTPUT_EVENTS = frozenset({"token", "done", "error", "cancelled"})

RENDER_CHARS_PER_MESSAGE = 16
"""What one message weighs, in characters of content, when `off_loop` decides whether a chat
is rendered on the event loop: the sim's template renders 2 messages in 8 µs and 32 in 16 µs;
a chat of many empty messages still goes to a thread."""

Prompt = str | list[int]
Jobs = list[tuple[JobCreate, JobSpec]]


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sent the request, and its Idempotency-Key (with the request's fingerprint)."""

    identity: Identity
    idempotency_key: str | None = None
    fingerprint: str | None = None
    detached: bool = False
    """Its jobs outlive the request (a background response): a disconnect cancels none."""

    @classmethod
    def of(cls, identity: Identity, key: str | None, kind: str, req: SamplingParams) -> Sender:
        if key is None:
            return cls(identity)
        return cls(identity, check_idempotency_key(key), _fingerprint(kind, req))


# ---- plan and prepare: the validation the live endpoints and the batch API share ----------


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

    def output_format(self, constraint: Constraint | None = None) -> OutputFormat:
        """The output's shape; `constraint`: the jobs' (a tools one: `tool_calls` read back)."""
        if isinstance(self.req, ChatCompletionRequest):
            return ChatFormat.of(self.want_logprobs, constraint)
        return CompletionFormat(self.want_logprobs)


def plan(req: OpenAIBody) -> Plan:
    """The request's prompts and limits; 400 for an empty prompt."""
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return Plan("chatcmpl", req, [], req.completion_limit, logprobs)
    return Plan("cmpl", req, _completion_prompts(req), req.max_tokens, req.logprobs)


def refuse(p: Plan) -> None:
    """400 for what no model could run: parameters genq cannot honour."""
    _refuse_unsupported(p.req)
    check_one_constraint(p.req)
    req = p.req
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")


async def prepare_jobs(
    state: GatewayState, p: Plan, loaded: LoadedCard, priority: Priority
) -> tuple[RequestState, list[tuple[JobCreate, JobSpec]]]:
    """Render (chat), validate and tokenize every prompt once against the model's card (400
    for a prompt that cannot run: too long, a template that refuses it); one job per
    (prompt, choice). Nothing is written yet."""
    req = p.req
    prompts = p.prompts
    if isinstance(req, ChatCompletionRequest):
        prompts = [await _render(state, loaded, req)]
    request_id = uuid.uuid4().hex
    run = RequestState(f"{p.kind}-{request_id}", int(time.time()), req.model, [], [])
    jobs: list[tuple[JobCreate, JobSpec]] = []
    for i, prompt in enumerate(prompts):
        body = _job_body(req, prompt, p.max_tokens, p.logprobs, p.prompt_param, priority)
        spec = await state.jobs.prepare(body)
        if isinstance(req, ChatCompletionRequest):
            spec = await _constrained(state, loaded, req, spec)
        run.prompt_tokens.append(len(spec.input_ids))
        for j in range(req.n):
            index = len(jobs)
            job_id = request_id if index == 0 else uuid.uuid4().hex
            seed = None if body.seed is None else (body.seed + j) % (MAX_SEED + 1)
            meta = _metadata(p.kind, run.id, index, req.user, req.prompt_cache_key)
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
            param = spec.constraint.field if spec.constraint is not None else None
            run.choices.append(ChoiceState(index, job_id, i, constraint_param=param))
    return run, jobs


async def _constrained(
    state: GatewayState, loaded: LoadedCard, req: ChatCompletionRequest, spec: JobSpec
) -> JobSpec:
    """`spec` under the constraint the request's `tools` (unless `tool_choice` is none; with
    a JSON `response_format` beside `auto` tools, the calls or that JSON) or `response_format`
    asks for, if any (checked and compiled as a native constraint is: a 400 naming the field
    otherwise)."""
    jobs = state.jobs
    tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    asked = response_schema(req.response_format)
    if tools is not None and tools.constrained:
        check_compatible(spec.sampling, "tools")
        constraint = await _tools_constraint(state, loaded, tools, asked)
        return spec.model_copy(update={"constraint": constraint})
    if asked is None:
        return spec
    check_compatible(spec.sampling, "response_format")
    constraint = await jobs.constraints.check(
        loaded,
        "json_schema",
        asked.schema,
        asked.param,
        jobs.off_loop,
        origin="response_format",
        strict=asked.strict,
    )
    return spec.model_copy(update={"constraint": constraint})


async def _tools_constraint(
    state: GatewayState, loaded: LoadedCard, tools: Tools, asked: AskedSchema | None
) -> Constraint:
    """The grammar of a reply under `tools` (and `asked`, beside `auto` tools): each
    function's parameters and the answer's schema planned first (a strict one's unenforceable
    keyword is a 400 naming it; a lenient one's are listed in `unenforced`)."""
    jobs = state.jobs
    family = family_of(_template(state, loaded))
    assert family is not None  # `_render` refused a template that takes no tools
    fmt = FORMATS[family]
    unenforced: list[str] = []
    functions = []
    for i, fn in enumerate(tools.functions):
        param, strict = f"tools.{i}.function.parameters", fn.get("strict") is True
        if tools.choice in ("auto", "required", fn["name"]):  # a 400 names the tool at fault
            schema = fn["parameters"]
            await jobs.constraints.check(
                loaded, "json_schema", schema, param, jobs.off_loop, strict=strict
            )
        planned = await jobs.constraints.plan(fn["parameters"], strict, param, jobs.off_loop)
        unenforced += [dotted(p, param) for p in planned.unenforced]
        functions.append({**fn, "parameters": planned.schema})
    answer = None
    if asked is not None and tools.choice == "auto":
        if not fmt.trigger:
            raise BadRequest(
                f"model '{loaded.card.name}' calls tools as plain JSON objects (Llama's "
                "format), which a reply in the response_format's schema could be too: give "
                "tools or a JSON response_format, not both, for this model",
                param="response_format",
                code="tools_with_response_format",
            )
        planned = await jobs.constraints.plan(
            asked.schema, asked.strict, asked.param, jobs.off_loop
        )
        unenforced += [dotted(p, asked.param) for p in planned.unenforced]
        answer = {**planned.schema, "x-guidance": json_options(not asked.strict)}
    tok = loaded.tokenizer
    special = frozenset(m for m in MARKERS if tok.token_to_id(m) is not None)
    lark = grammar_for(fmt, replace(tools, functions=functions), special, answer)
    constraint = await jobs.constraints.check(
        loaded, "grammar", lark, "tools", jobs.off_loop, origin=f"{TOOLS_ORIGIN}{family}"
    )
    update: dict[str, Any] = {"unenforced": unenforced}
    if answer is not None and asked is not None:
        update |= {"answer_schema": asked.schema, "calls_start": fmt.trigger}
        update["strict"] = asked.strict
    return constraint.model_copy(update=update)


def _template(state: GatewayState, loaded: LoadedCard) -> str | None:
    return loaded.card.chat_template or state.settings.default_chat_template


async def _render(state: GatewayState, loaded: LoadedCard, req: ChatCompletionRequest) -> str:
    """The chat as prompt text: its size checked first, then rendered off the event loop (a
    template over thousands of messages is seconds of pure Python); a small chat renders on
    the loop (`off_loop`, `RENDER_CHARS_PER_MESSAGE`)."""
    for i, m in enumerate(req.messages):
        _check_message(i, m)
    settings = state.settings
    card = loaded.card
    template = _template(state, loaded)
    if template is None:
        raise BadRequest(
            f"model '{card.name}' has no chat template (and no GENQ_DEFAULT_CHAT_TEMPLATE is "
            "configured); use /v1/completions with a formatted prompt",
            param="messages",
            code="chat_template_missing",
        )
    messages = [template_message(_message_dict(i, m)) for i, m in enumerate(req.messages)]
    extra: dict[str, Any] = {}
    tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if tools is not None:
        if family_of(template) is None:
            raise BadRequest(
                f"model '{card.name}''s chat template takes no tools in a format genq reads "
                "(Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS], Llama 3.1+ JSON): genq does "
                "not put tools in a prompt the model was not trained to read",
                param="tools",
                code="tools_unsupported",
            )
        extra["tools"] = template_tools(tools)
    chars = sum(len(m.get("content") or "") for m in messages)
    if chars > settings.max_prompt_chars:
        raise BadRequest(
            f"the messages' content is {chars} characters; the limit "
            f"(GENQ_MAX_PROMPT_CHARS) is {settings.max_prompt_chars}",
            param="messages",
        )
    text = await state.jobs.off_loop(
        functools.partial(
            render_chat,
            template,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            bos_token=card.bos_token,
            eos_token=card.eos_token,
            **extra,
        ),
        chars + RENDER_CHARS_PER_MESSAGE * len(messages),
    )
    if card.add_bos and card.bos_token and text.startswith(card.bos_token):
        text = text[len(card.bos_token) :]  # JobService adds the BOS token itself
    return text


# ---- the live endpoints -------------------------------------------------------------------


class OpenAIServing:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.settings = state.settings

    async def completions(
        self,
        req: CompletionRequest,
        request: Request,
        identity: Identity,
        idempotency_key: str | None = None,
    ) -> Response:
        return await self._serve(
            plan(req), request, Sender.of(identity, idempotency_key, "cmpl", req)
        )

    async def chat(
        self,
        req: ChatCompletionRequest,
        request: Request,
        identity: Identity,
        idempotency_key: str | None = None,
    ) -> Response:
        sender = Sender.of(identity, idempotency_key, "chatcmpl", req)
        return await self._serve(plan(req), request, sender)

    async def _serve(self, p: Plan, request: Request, sender: Sender) -> Response:
        loaded = await self._admit(p.req.model, p.jobs, sender, p.req.priority)
        refuse(p)  # after the model: one genq does not serve is a 404 first
        run, jobs = await prepare_jobs(self.state, p, loaded, p.req.priority)
        fmt = p.output_format(jobs[0][1].constraint)
        return await self._respond(p.req, request, sender, run, jobs, fmt)

    async def _admit(
        self, model: str, jobs: int, sender: Sender, priority: Priority = "interactive"
    ) -> LoadedCard:
        s, state = self.settings, self.state
        if state.draining:
            raise Unavailable("this gateway is shutting down; retry on another")
        loaded = await state.registry.get(model)  # ModelNotFound (404) if never served
        if jobs > s.openai_max_jobs:
            raise BadRequest(
                f"this request asks for {jobs} completions (n x prompts); the limit "
                f"(GENQ_OPENAI_MAX_JOBS) is {s.openai_max_jobs}",
                param="n",
            )
        beats = await state.registry.live_workers()
        if not any(b.model == loaded.card.name and not b.draining for b in beats):
            raise Unavailable(
                f"no live worker serves model '{model}' right now; retry later",
                param="model",
                code="model_unavailable",
            )
        if sender.idempotency_key is None:
            name = loaded.card.name
            await state.admission.precheck(sender.identity, name, priority, jobs)
        else:  # a replay is answered whatever the limits say now: SUBMIT checks them after
            await state.admission.check_memory()
        return loaded

    # ---- start and output -----------------------------------------------------------------

    async def _respond(
        self,
        req: SamplingParams,
        request: Request,
        sender: Sender,
        run: RequestState,
        jobs: Jobs,
        fmt: OutputFormat,
    ) -> Response:
        followers = await self._start(sender, run, jobs)
        headers = {"X-Job-Ids": ",".join(c.job_id for c in run.choices)}
        headers |= unenforced_header(jobs[0][1].constraint)
        if req.stream:
            stream = self._sse(sender, run, followers, fmt, req.include_usage)
            stopped = ErrorResponse(error=self.stopped_error(sender, run))
            response = EventStreamResponse(
                stream,
                run.choices[0].job_id,
                stall_timeout_s=self.settings.stream_stall_timeout_s,
                on_stop=lambda: _frame(stopped) + DONE_FRAME,
            )
            response.headers.update(headers)
            return response
        collect = asyncio.create_task(self._collect(run, followers))
        gone = asyncio.create_task(disconnected(request))
        stopping = asyncio.create_task(self.state.stopping.wait_end())
        try:
            await asyncio.wait({collect, gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            with anyio.CancelScope(shield=True):
                await stop_tasks([collect, gone, stopping])
                await self._close(sender, run, followers)
        if not collect.cancelled():
            collect.result()  # raises what collecting raised
            headers |= validity_header([c.schema_check for c in run.choices])
            return JSONResponse(fmt.response(run).model_dump(mode="json"), headers=headers)
        if not stopping.cancelled():
            error = self.stopped_error(sender, run)
            raise Unavailable(error.message, code=error.code)
        log.info("client disconnected", extra={"job_id": run.choices[0].job_id})
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    def stopped_error(self, sender: Sender, run: RequestState) -> ErrorDetail:
        """What a request still waiting for its jobs is told when the gateway stops: whether
        they go on, or are cancelled with it (they are, unless a retry may come back for
        them)."""
        ids = [c.job_id for c in run.choices]
        if self._mortal(sender, ids):
            then = "they are cancelled with it"
        else:
            then = (
                "they go on when a worker runs them again (GET /v1/jobs/{id}; the request sent "
                "again with its Idempotency-Key follows them)"
            )
        return ErrorDetail(
            message=f"the server is stopping before this request's jobs ({', '.join(ids)}) "
            f"ended; {then}",
            type="server_error",
            code=SERVER_STOPPING,
        )

    async def _start(self, sender: Sender, run: RequestState, jobs: Jobs) -> list[EventFollower]:
        """Subscribe each job's channel, then queue the job; undo it all if one fails (but
        a request with an Idempotency-Key keeps its jobs: a retry with the key takes them).
        Jobs a disconnect cancels die with this gateway too (registered before they exist).
        The first job charges the whole request's tokens to the key's tokens per minute, so
        a request is admitted or refused by it whole (one refused later by a queue limit, in
        a race past the precheck, keeps its charge: at most its own tokens, refilled within
        a minute)."""
        followers: list[EventFollower] = []
        mortal = self._mortal(sender, (spec.id for _, spec in jobs))
        cost = sum(job_cost(spec) for _, spec in jobs)
        try:
            await self.state.presence.register(mortal)
            for index, (body, spec) in enumerate(jobs):
                charge = cost if index == 0 else 0
                followers.append(await self._submit(sender, run, index, body, spec, charge))
        except BaseException:
            with anyio.CancelScope(shield=True):
                for f in followers:
                    await f.sub.close()
                with contextlib.suppress(RedisError, OSError):
                    await self.state.presence.unregister(mortal)
                if sender.idempotency_key is None:
                    for f in followers:
                        with contextlib.suppress(GenqError, RedisError, OSError):
                            await self.state.jobs.cancel(
                                f.job_id, sender.identity, "request failed"
                            )
            raise
        return followers

    def _mortal(self, sender: Sender, job_ids: Iterable[str]) -> list[str]:
        """The jobs a disconnect cancels: all, unless `openai_cancel_on_disconnect` is off or
        the request has an Idempotency-Key (a retry with it comes back for them)."""
        if (
            not self.settings.openai_cancel_on_disconnect
            or sender.idempotency_key is not None
            or sender.detached
        ):
            return []
        return list(job_ids)

    async def _submit(
        self,
        sender: Sender,
        run: RequestState,
        index: int,
        body: JobCreate,
        spec: JobSpec,
        charge: int,
    ) -> EventFollower:
        """Queue job `index` of the request, subscribed first; the job an earlier request
        with the same Idempotency-Key made instead, if any (then the request is that one's:
        its id and creation time)."""
        state = self.state
        if index > 0:  # the request's id is job 0's, known now
            body = body.model_copy(update={"metadata": {**body.metadata, "request": run.id}})
        spec = spec.model_copy(update={"followed": not sender.detached})  # it waits, or streams
        sub = await state.router.subscribe(state.keys.channel(spec.id))
        try:
            submitted = await state.jobs.submit(
                body,
                sender.idempotency_key,
                spec,
                caller=sender.identity,
                part=index,
                fingerprint=sender.fingerprint,
                charge=charge,
            )
            job = submitted.job
            if submitted.replayed:  # its events from the start: the log replays them
                await sub.close()
                sub = await state.router.subscribe(state.keys.channel(job.id))
        except BaseException:
            await sub.close()
            raise
        run.choices[index].job_id = job.id
        if index == 0:
            run.id = f"{run.id.partition('-')[0]}-{job.id}"
            run.created = int(job.created_at)
        return EventFollower(
            state.redis, state.keys, state.settings, sub, job.id, ended=state.jobs.placement.ended
        )

    async def _collect(self, run: RequestState, followers: list[EventFollower]) -> None:
        """Follow every job to its end; raise the first failure as an error."""
        async for index, batch in merged(followers):
            if batch is not None:
                for ev in _output_events(batch):
                    run.choices[index].apply(ev)
        for c in run.choices:
            f = c.failure
            if f is not None and f.type == "invalid_request_error":  # its constraint: a 400
                raise BadRequest(f.message, param=f.param, code=f.code)
            if f is not None:
                cls = Conflict if f.code == "cancelled" else GenqError
                raise cls(f.message, code=f.code)
            if not c.ended:
                raise GenqError(f"job {c.job_id} ended without a result", code="job_lost")

    async def _sse(
        self,
        sender: Sender,
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
                    if isinstance(ev, TokenEvent):  # sent on, not kept: memory stays bounded
                        chunk = fmt.token_chunk(run, choice, ev)
                        out += [_frame(chunk)] if chunk is not None else []
                        continue
                    choice.apply(ev)
                    if choice.finish_reason is not None:
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
                await self._close(sender, run, followers)

    async def _close(
        self, sender: Sender, run: RequestState, followers: list[EventFollower]
    ) -> None:
        """Unsubscribe; cancel the jobs nobody will read (the client left, or another failed),
        unless the request has an Idempotency-Key (a retry with it comes back for them)."""
        for f in followers:
            await f.sub.close()
        mortal = self._mortal(sender, (c.job_id for c in run.choices))
        why = STOPPED_REASON if self.state.stopping.ending_streams else "client disconnected"
        for c in run.choices:
            if not c.ended and c.job_id in mortal:
                with contextlib.suppress(GenqError, RedisError, OSError):
                    await self.state.jobs.cancel(c.job_id, sender.identity, why)
        with contextlib.suppress(RedisError, OSError):
            await self.state.presence.unregister(mortal)


# ---- helpers ------------------------------------------------------------------------------


UNENFORCED_HEADER = "genq-schema-unenforced"
VALID_HEADER = "genq-schema-valid"


def unenforced_header(constraint: Constraint | None) -> dict[str, str]:
    """`genq-schema-unenforced`: the keywords of the request's JSON schemas its grammar does
    not enforce (none: the header is absent); the job record has their paths."""
    if constraint is None or not constraint.unenforced:
        return {}
    return {
        UNENFORCED_HEADER: ",".join(dict.fromkeys(keyword_of(p) for p in constraint.unenforced))
    }


def validity_header(checks: list[SchemaCheck | None]) -> dict[str, str]:
    """`genq-schema-valid`: per choice, in order, whether its output is valid under the whole
    schema (`true`, `false`; `null` where not checked); absent without a JSON schema."""
    if all(c is None for c in checks):
        return {}
    shown = ("null" if c is None or c.valid is None else str(c.valid).lower() for c in checks)
    return {VALID_HEADER: ",".join(shown)}


def _output_events(batch: Batch) -> list[Any]:
    return [events.decode(data) for _, etype, data in batch if etype in _OUTPUT_EVENTS]


def _frame(chunk: BaseModel) -> bytes:
    return b"data: " + sse_data(chunk.model_dump_json()).encode() + b"\n\n"


def _refuse_unsupported(req: SamplingParams) -> None:
    """A clear 400 for OpenAI parameters genq knows but cannot honour (not a silent drop)."""
    unsupported: dict[str, bool] = {}
    if isinstance(req, CompletionRequest):
        unsupported |= {
            "echo": req.echo,
            "best_of": req.best_of is not None and req.best_of != req.n,
            "suffix": bool(req.suffix),
        }
    if isinstance(req, ChatCompletionRequest):
        response_schema(req.response_format)  # the shapes: a 400 before any work
        check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    for param, given in unsupported.items():
        if given:
            raise BadRequest(
                f"'{param}' is not supported by genq", param=param, code="unsupported_parameter"
            )


def check_one_constraint(req: OpenAIBody, names: Mapping[str, str] | None = None) -> None:
    """One constraint at most: a native field (`json_schema`, `regex`, `grammar`), or for a
    chat a JSON `response_format` or `tools` (unless tool_choice is none); a 400 naming the
    fields given, as `names` calls them (the Responses API's own names)."""
    given: list[str] = [k for k in CONSTRAINT_KINDS if getattr(req, k) is not None]
    if not given:  # the other pairs are the chat path's own to judge (_refuse_unsupported)
        return
    if isinstance(req, ChatCompletionRequest):
        if response_schema(req.response_format) is not None:
            given.append("response_format")
        tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        if tools is not None and tools.constrained:
            given.append("tools")
    if len(given) > 1:  # the param: genq's own field given last, as the native API names it
        shown_as = [(names or {}).get(g, g) for g in given]
        native = [g for g in shown_as if g in CONSTRAINT_KINDS]
        raise BadRequest(one_only(shown_as), param=native[-1])


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


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles OpenAI accepts in a chat request."""


def _check_message(index: int, m: ChatMessage) -> None:
    """The checks OpenAI makes: a known role; content in every message but an assistant's
    that calls tools (or a function's); a tool's reply names its call."""
    if m.role not in CHAT_ROLES:
        allowed = ", ".join(f"'{r}'" for r in CHAT_ROLES)
        raise BadRequest(
            f"messages.{index}.role is {shown(m.role)}; allowed: {allowed}",
            param=f"messages.{index}.role",
        )
    extra = m.model_extra or {}
    calls = extra.get("tool_calls") or extra.get("function_call")
    if m.content is None and m.role != "function" and not (m.role == "assistant" and calls):
        needs = "content (or tool_calls)" if m.role == "assistant" else "content"
        raise BadRequest(
            f"messages.{index} ({m.role}) has no content; a {m.role} message needs {needs}",
            param=f"messages.{index}.content",
        )
    if m.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
        raise BadRequest(
            f"messages.{index} (tool) has no tool_call_id: a tool message answers one call",
            param=f"messages.{index}.tool_call_id",
        )


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


_PASSED_ON = (*AS_IS, "timeout_s")
"""Fields of an OpenAI request that become the job's as they are, when given."""


def _job_body(
    req: OpenAIBody,
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
    native = (*CONSTRAINT_KINDS, "json_schema_strict")
    for name in (*_PASSED_ON, *native):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    try:
        return JobCreate(**fields)
    except ValidationError as exc:
        e = exc.errors()[0]
        named = (e.get("ctx") or {}).get("param")  # a check of several fields names its own
        loc = [str(x) for x in e.get("loc", ())] or [str(named or "body")]
        param = prompt_param if loc[0] in ("prompt", "input_ids") else ".".join(loc)
        raise Unprocessable(f"{param}: {e.get('msg', 'invalid')}", param=param) from None


def _fingerprint(kind: str, req: SamplingParams) -> str:
    """What makes two requests the same: every field genq reads (not ignored extras), but
    not how the output is delivered (`stream`, `stream_options`)."""
    fields = set(type(req).model_fields) - {"stream", "stream_options"}
    canonical = req.model_dump_json(include=fields)
    return hashlib.sha256(f"{kind}:{canonical}".encode()).hexdigest()


def _metadata(
    kind: str, request_id: str, index: int, user: str | None, cache_key: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"api": f"openai.{kind}", "request": request_id, "choice": index}
    if user is not None:
        meta["user"] = user
    if cache_key is not None:
        meta["prompt_cache_key"] = cache_key
    return meta
