"""OpenAI's Responses API as another face of a chat job.

`POST /v1/responses` turns its `input` (a string, or input items: messages with text parts,
`function_call` and `function_call_output` items), its `instructions` and the conversation of
`previous_response_id` into chat messages, and its `text.format`, `tools` and `tool_choice`
into the chat fields they mirror; the chat path (gateway/openai/serving.py) checks, renders
and queues the one job, as it would a chat completion. The response id is `resp_<job id>`:
the job's record and event log are the response's, so it shows at `/v1/jobs/{id}` too, and
any gateway answers `GET /v1/responses/{id}` (its stream too, from any `starting_after`).

What the job record does not hold is kept beside it, in the job's slot (`Keys.response`):
the owner, the request's parameters as the answer echoes them, and the conversation up to
this turn's input (`previous_response_id` carries on from there). It lives as long as the
job's record: set at creation for the retention period past the job's longest life, then
aligned with the record's own TTL once the job has ended. `store: false` keeps nothing
beside the job: the answer is the only copy (`GET` is a 404, as OpenAI's), and it cannot be
`background`.

Stream events, in OpenAI's names and order, are numbered from the job's own event seqs, so
the same event has the same `sequence_number` on every gateway and every replay:
`response.created` 0, `response.in_progress` 1, then (text) `response.output_item.added` 2,
`response.content_part.added` 3, each token event of seq s a `response.output_text.delta`
numbered s + 2 (a token's seq is at least 2), and the closing events after the job's final
event of seq d numbered from d + 2. Tool calls (and text beside them) are emitted whole at the
end, as their text is read back by the tool format (one `function_call_arguments.delta` with
all the arguments). A cancelled response's stream ends with `response.cancelled` (the name of
OpenAI's webhook event; the SDK passes an event it does not know through as it is).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Any, Literal

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field
from redis.exceptions import RedisError

from gateway.http_errors import ErrorDetail
from gateway.identity import Identity
from gateway.job_service import check_idempotency_key
from gateway.keepalive import KEEPALIVE
from gateway.openai.merge import disconnected, merged, stop_tasks
from gateway.openai.output import ChatFormat, ChoiceState, RequestState
from gateway.openai.protocol import (
    MAX_CHAT_MESSAGES,
    MAX_NAME_CHARS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    NativeConstraints,
    OpenAIRequest,
)
from gateway.openai.serving import (
    CLIENT_CLOSED_REQUEST,
    OpenAIServing,
    Sender,
    check_one_constraint,
    plan,
    prepare_jobs,
    refuse,
    unenforced_header,
    validity_header,
)
from gateway.openai.toolcalls import tool_format_of
from gateway.streaming import EventFollower, EventStreamResponse, sse_data
from shared import events
from shared.constraints import SchemaCheck
from shared.errors import BadRequest, GenqError, NotFound, Unavailable
from shared.events import CancelledEvent, DoneEvent, ErrorEvent, TokenEvent
from shared.keys import Priority
from shared.records import JOB_ID
from shared.schemas import ONE_CONSTRAINT, JobView, MaxTokens, TimeoutS, Usage

RESPONSE_PREFIX = "resp_"
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
CONTEXT_TTL_RETENTIONS = 2
"""A stored response's context lives this many retention periods (GENQ_RETENTION_S) from its
creation, and again from each read while its job has not ended; then as long as the job's
record does."""
CANCEL_WAIT_S = 2.0
"""How long `POST /v1/responses/{id}/cancel` waits for a running job to stop before it
answers (the answer says `cancelled` once it has, `in_progress` with the cancel asked if not)."""
_STATUS: dict[str, str] = {
    "queued": "queued",
    "running": "in_progress",
    "succeeded": "completed",
    "failed": "failed",
    "expired": "failed",
    "cancelled": "cancelled",
}


class InputText(OpenAIRequest):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(OpenAIRequest):
    """A message item (`type` may be left out, as the SDK's easy input messages do)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(OpenAIRequest):
    """A function call the model made (sent back with the conversation)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    arguments: str


class FunctionCallOutputItem(OpenAIRequest):
    """A function's result, for the call of `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    output: str


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE)]
_BACKGROUND_IS_STORED: dict[str, Any] = {
    "if": {"required": ["background"], "properties": {"background": {"const": True}}},
    "then": {"properties": {"store": {"const": True}}},
}
"""The document says what the 400 says: a background response is stored."""


class ResponsesRequest(NativeConstraints):
    """Body of `POST /v1/responses`. Fields genq does not know are ignored (as the chat
    endpoint does); `reasoning`, `include`, `truncation` and built-in tools are not served.
    genq's own constraint fields (`json_schema`, `regex`, `grammar`) are served as on the chat
    endpoint."""

    model_config = ConfigDict(json_schema_extra={**_BACKGROUND_IS_STORED, **ONE_CONSTRAINT})

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)] = (
        Field(
            description="a user message, or input items: messages (`role`, `content` as a string "
            "or `input_text` / `output_text` parts), `function_call` and `function_call_output`"
        )
    )
    instructions: str | None = Field(
        default=None, description="a system message first; not carried to the next turn"
    )
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    background: bool = Field(
        default=False,
        description="answer at once (status `queued`); poll or stream it with GET, from any "
        "gateway; it is not cancelled when the client goes",
    )
    store: bool = True
    metadata: dict[str, MetadataValue] | None = Field(
        default=None,
        max_length=MAX_METADATA_PAIRS,
        json_schema_extra={"propertyNames": {"maxLength": MAX_METADATA_KEY}},
    )
    previous_response_id: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    text: dict[str, Any] | None = Field(
        default=None, description='`{"format": {"type": "text" | "json_object" | "json_schema"}}`'
    )
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="function tools: `{type: function, name, parameters, strict}`"
    )
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    priority: Priority = Field(
        default="interactive", description="genq: `batch` for background work that can wait"
    )
    timeout_s: TimeoutS | None = Field(
        default=None, description="genq: the job's deadline, as on the native API"
    )


@dataclass(slots=True)
class Stored:
    """What a response keeps beside its job (`Keys.response`)."""

    owner: str | None
    created_at: float
    request: dict[str, Any]
    """The parameters the answer echoes (instructions, tools, metadata, …)."""
    messages: list[dict[str, Any]]
    """The conversation up to this turn's input (chat messages, instructions not included)."""
    background: bool = False

    def encode(self) -> str:
        return json.dumps(
            {
                "owner": self.owner,
                "created_at": self.created_at,
                "request": self.request,
                "messages": self.messages,
                "background": self.background,
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, raw: str) -> Stored:
        d = json.loads(raw)
        return cls(d["owner"], d["created_at"], d["request"], d["messages"], d["background"])


def job_id_of(response_id: str) -> str:
    """The job of `resp_<job id>`; 404 for anything else."""
    job_id = response_id.removeprefix(RESPONSE_PREFIX)
    if not response_id.startswith(RESPONSE_PREFIX) or not JOB_ID.fullmatch(job_id):
        raise not_found(response_id)
    return job_id


def not_found(response_id: str) -> NotFound:
    return NotFound(f"no response '{response_id[:80]}'", param="response_id")


# ---- request → chat -----------------------------------------------------------------------


def _text_of(content: str | list[InputText]) -> str:
    """A message's text: a string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Chat messages for the request's `input`: a developer message is the system's, function
    calls in a row are one assistant message's `tool_calls`, an output is a `tool` message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            fn = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": fn}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's shape; 400 for another kind of tool."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise BadRequest(
                f"tools.{i}: genq serves function tools; {kind!r} is not supported",
                param=f"tools.{i}",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


_CHAT_TO_RESPONSES = (
    ("response_format.json_schema.", "text.format."),
    ("response_format", "text.format"),
)


def responses_path(path: str) -> str:
    """A chat field's path (how the request was checked) as the Responses request named it:
    `response_format.json_schema.…` is `text.format.…`, `tools.N.function.…` is `tools.N.…`."""
    for chat, own in (
        ("response_format.json_schema.", "text.format."),
        ("response_format", "text.format"),
    ):
        if path.startswith(chat):
            return own + path[len(chat) :]
    return re.sub(r"^tools\.(\d+)\.function\.", r"tools.\1.", path)


def _in_responses_terms(exc: BadRequest) -> BadRequest:
    if exc.param is None:
        return exc
    own = responses_path(exc.param)
    if own == exc.param:
        return exc
    return type(exc)(exc.message.replace(exc.param, own), param=own, code=exc.code)


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadRequest("text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return fmt


def _echoed(req: ResponsesRequest) -> dict[str, Any]:
    """The request's parameters as a response shows them."""
    return {
        "model": req.model,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "metadata": req.metadata or {},
        "previous_response_id": req.previous_response_id,
        "text": req.text or {"format": {"type": "text"}},
        "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "user": req.user,
        "store": req.store,
    }


# ---- output -------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """A response's job as far as known: its status and what it said."""

    job_id: str
    status: str
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: dict[str, Any] | None = None
    prompt_tokens: int = 0
    tools_origin: str | None = None
    finished_at: float | None = None
    schema_check: SchemaCheck | None = None


def _output(o: Outcome, done: bool) -> list[dict[str, Any]]:
    """The response's output items: a message (when there is text) and its function calls."""
    choice = ChoiceState(0, o.job_id, 0, text=[o.text], finish_reason=o.finish_reason or "stop")
    fmt = ChatFormat(False, tool_format_of(SimpleNamespace(origin=o.tools_origin)))
    run = RequestState("x", 0, "", [choice], [0])
    chat = fmt.response(run)
    assert isinstance(chat, ChatCompletionResponse)
    message = chat.choices[0].message
    items: list[dict[str, Any]] = []
    status = "completed" if done else "in_progress"
    if o.status == "incomplete":
        status = "incomplete"
    if message.content:
        items.append(_message_item(o.job_id, message.content, status))
    for call in message.tool_calls or []:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{call.id}",
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": "completed",
            }
        )
    return items


def _message_item(job_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "type": "message",
        "id": f"msg_{job_id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_body(stored: Stored, o: Outcome, *, output: bool = True) -> dict[str, Any]:
    """The Response object for `o` (its output only once `output`: the job has ended)."""
    ended = o.status in ("completed", "incomplete", "failed", "cancelled")
    usage = None
    if o.usage is not None:
        usage = {
            "input_tokens": o.usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": o.usage.cached_tokens},
            "output_tokens": o.usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": o.usage.prompt_tokens + o.usage.completion_tokens,
        }
    return {
        "id": RESPONSE_PREFIX + o.job_id,
        "object": "response",
        "created_at": int(stored.created_at),
        "status": o.status,
        "background": stored.background,
        "error": o.error,
        "incomplete_details": {"reason": "max_output_tokens"} if o.status == "incomplete" else None,
        "output": _output(o, ended) if output and ended and o.status != "failed" else [],
        "usage": usage,
        "completed_at": int(o.finished_at) if o.status == "completed" and o.finished_at else None,
        **stored.request,
        **({"genq_schema": o.schema_check.model_dump()} if o.schema_check else {}),
    }


def outcome_of(view: JobView) -> Outcome:
    status = _STATUS[view.status]
    if status == "completed" and view.finish_reason == "length":
        status = "incomplete"
    error = None
    if view.error is not None and status == "failed":
        error = {"code": view.error.code, "message": view.error.message}
    origin = (view.constraint or {}).get("origin")
    return Outcome(
        view.id,
        status,
        view.text or "",
        view.finish_reason,
        view.usage,
        error,
        tools_origin=origin,
        finished_at=view.finished_at,
        schema_check=view.schema_check,
    )


# ---- stream events ------------------------------------------------------------------------


class EventNumbering:
    """The Responses stream of one job, its events numbered from the job's seqs (see the
    module's doc), each sent only when its number is past `after`."""

    def __init__(self, stored: Stored, o: Outcome, after: int) -> None:
        self.stored = stored
        self.o = o
        self.after = after
        self.text_mode = tool_format_of(SimpleNamespace(origin=o.tools_origin)) is None
        self.opened = False
        self.ended = False
        self.last = after
        """The number of the last event sent."""
        self._text: list[str] = []

    def _frame(self, number: int, kind: str, **data: Any) -> bytes:
        if number <= self.after:
            return b""
        self.last = number
        body = {"type": kind, "sequence_number": number, **data}
        text = sse_data(json.dumps(body, separators=(",", ":")))
        return f"event: {kind}\ndata: {text}\n\n".encode()

    def created(self) -> bytes:
        return self._frame(0, "response.created", response=response_body(self.stored, self.o))

    def error(self, detail: ErrorDetail) -> bytes:
        """An `error` event ending the stream before the response ends (the gateway stops).
        It repeats the last event's number, so that a resume after it misses nothing."""
        body = {
            "type": "error",
            "sequence_number": max(self.last, 0),
            "code": detail.code,
            "message": detail.message,
            "param": detail.param,
        }
        return f"event: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()

    def opening(self) -> bytes:
        if self.opened:
            return b""
        self.opened = True
        self.o.status = "in_progress"
        out = self._frame(1, "response.in_progress", response=response_body(self.stored, self.o))
        if self.text_mode:
            item = _message_item(self.o.job_id, None, "in_progress")
            out += self._frame(2, "response.output_item.added", output_index=0, item=item)
            out += self._frame(
                3,
                "response.content_part.added",
                item_id=item["id"],
                output_index=0,
                content_index=0,
                part=_text_part(""),
            )
        return out

    def token(self, ev: TokenEvent) -> bytes:
        out = self.opening()
        self._text.append(ev.text)
        if self.text_mode and ev.text:
            out += self._frame(
                ev.seq + 2,
                "response.output_text.delta",
                item_id=f"msg_{self.o.job_id}",
                output_index=0,
                content_index=0,
                delta=ev.text,
                logprobs=[],
            )
        return out

    def end(self, ev: DoneEvent | ErrorEvent | CancelledEvent) -> bytes:
        out = self.opening()
        self.ended = True
        o = self.o
        o.text = "".join(self._text)
        o.finished_at = time.time()
        n = ev.seq + 2
        if isinstance(ev, ErrorEvent):
            o.status, o.error = "failed", {"code": ev.code, "message": ev.message}
            return out + self._frame(n, "response.failed", response=response_body(self.stored, o))
        if isinstance(ev, CancelledEvent):
            o.status = "cancelled"
            body = response_body(self.stored, o)
            return out + self._frame(n, "response.cancelled", response=body)
        o.finish_reason, o.usage, o.schema_check = ev.finish_reason, ev.usage, ev.schema_check
        o.status = "incomplete" if ev.finish_reason == "length" else "completed"
        frames: list[bytes] = []
        if self.text_mode:
            item_id = f"msg_{o.job_id}"
            where = {"item_id": item_id, "output_index": 0, "content_index": 0}
            frames.append(
                self._frame(n, "response.output_text.done", **where, text=o.text, logprobs=[])
            )
            frames.append(
                self._frame(n + 1, "response.content_part.done", **where, part=_text_part(o.text))
            )
            item = _message_item(
                o.job_id, o.text, "incomplete" if o.status == "incomplete" else "completed"
            )
            frames.append(
                self._frame(n + 2, "response.output_item.done", output_index=0, item=item)
            )
            n += 3
        else:
            for index, item in enumerate(_output(o, True)):
                frames.append(self._item_frames(n, index, item))
                n += 6
        kind = "response.incomplete" if o.status == "incomplete" else "response.completed"
        frames.append(self._frame(n, kind, response=response_body(self.stored, o)))
        return out + b"".join(frames)

    def _item_frames(self, n: int, index: int, item: dict[str, Any]) -> bytes:
        """An output item whole (tool calls, and the text beside them): added, its content in
        one delta, done; six numbers whatever its kind."""
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"] if item["content"] else ""
            opened = {**item, "status": "in_progress", "content": []}
            part = {**where, "content_index": 0}
            return b"".join(
                (
                    self._frame(n, "response.output_item.added", output_index=index, item=opened),
                    self._frame(n + 1, "response.content_part.added", **part, part=_text_part("")),
                    self._frame(
                        n + 2, "response.output_text.delta", **part, delta=text, logprobs=[]
                    ),
                    self._frame(n + 3, "response.output_text.done", **part, text=text, logprobs=[]),
                    self._frame(n + 4, "response.content_part.done", **part, part=_text_part(text)),
                    self._frame(n + 5, "response.output_item.done", output_index=index, item=item),
                )
            )
        args = item["arguments"]
        opened = {**item, "status": "in_progress", "arguments": ""}
        return b"".join(
            (
                self._frame(n, "response.output_item.added", output_index=index, item=opened),
                self._frame(n + 1, "response.function_call_arguments.delta", **where, delta=args),
                self._frame(
                    n + 2, "response.function_call_arguments.done", **where, arguments=args
                ),
                self._frame(n + 3, "response.output_item.done", output_index=index, item=item),
            )
        )


# ---- serving ------------------------------------------------------------------------------


class ResponsesServing(OpenAIServing):
    async def create(
        self,
        req: ResponsesRequest,
        request: Request,
        identity: Identity,
        idempotency_key: str | None = None,
    ) -> Response:
        sender = Sender(identity, detached=req.background)
        if idempotency_key is not None:  # the same key and body: the same response
            fingerprint = hashlib.sha256(
                b"resp:" + req.model_dump_json(exclude={"stream"}).encode()
            ).hexdigest()
            key = check_idempotency_key(idempotency_key)
            sender = Sender(identity, key, fingerprint, detached=req.background)
        loaded = await self._admit(req.model, 1, sender, req.priority)  # the model: 404 first
        if req.background and not req.store:
            raise BadRequest("background responses must be stored (store: true)", param="store")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = await self._history(req.previous_response_id, identity)
        turn = input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        fields = {
            "model": req.model,
            "messages": system + history + turn,
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": chat_response_format(req.text),
            "user": req.user,
            "prompt_cache_key": req.prompt_cache_key,
            "priority": req.priority,
            "timeout_s": req.timeout_s,
            "json_schema": req.json_schema,
            "regex": req.regex,
            "grammar": req.grammar,
        }
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}, strict=False
        )
        check_one_constraint(chat, {"response_format": "text.format"})
        p = plan(chat)
        refuse(p)
        try:
            run, jobs = await prepare_jobs(self.state, p, loaded, chat.priority)
        except BadRequest as exc:
            raise _in_responses_terms(exc) from None
        body, spec = jobs[0]
        if spec.constraint is not None and spec.constraint.unenforced:
            unenforced = [responses_path(u) for u in spec.constraint.unenforced]
            constraint = spec.constraint.model_copy(update={"unenforced": unenforced})
            spec = spec.model_copy(update={"constraint": constraint})
        meta = {**body.metadata, "api": "openai.response"}
        jobs[0] = (body.model_copy(update={"metadata": meta}), spec)
        stored = Stored(identity.owner, time.time(), _echoed(req), history + turn, req.background)
        if req.store:
            await self._store(spec.id, stored)
        followers = await self._start(sender, run, jobs)
        job_id = run.choices[0].job_id
        if job_id != spec.id:  # an Idempotency-Key's replay: the earlier response, as it was
            await self.state.redis.delete(self.state.keys.response(spec.id))
            stored, _ = await self._load(job_id, identity)
        origin = spec.constraint.origin if spec.constraint is not None else None
        queued = Outcome(job_id, "queued", prompt_tokens=run.prompt_tokens[0], tools_origin=origin)
        headers = unenforced_header(spec.constraint)
        if req.stream:
            numbering = EventNumbering(stored, queued, -1)
            stream = self._events(sender, run, followers[0], numbering)
            stopped = self.stopped_error(sender, run)
            response = EventStreamResponse(
                stream,
                job_id,
                stall_timeout_s=self.settings.stream_stall_timeout_s,
                on_stop=lambda: numbering.error(stopped),
            )
            response.headers.update(headers)
            return response
        if req.background:
            await self._close(sender, run, followers)
            return JSONResponse(response_body(stored, queued), headers=headers)
        if not await self._wait(request, sender, run, followers):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        view = await self.state.jobs.get(job_id, identity)
        headers |= validity_header([view.schema_check])
        return JSONResponse(response_body(stored, outcome_of(view)), headers=headers)

    async def retrieve(
        self, response_id: str, identity: Identity, stream: bool, starting_after: int | None
    ) -> Response:
        job_id = job_id_of(response_id)
        stored, view = await self._load(job_id, identity)
        o = outcome_of(view)
        if not stream:
            return JSONResponse(response_body(stored, o))
        state = self.state
        o.status = "queued"
        sub = await state.router.subscribe(state.keys.channel(job_id))
        follower = EventFollower(
            state.redis, state.keys, state.settings, sub, job_id, ended=state.jobs.placement.ended
        )
        run = RequestState(
            response_id, int(stored.created_at), view.model, [ChoiceState(0, job_id, 0)], [0]
        )
        after = -1 if starting_after is None else starting_after
        numbering = EventNumbering(stored, o, after)
        sender = Sender(identity, detached=True)
        stream_ = self._events(sender, run, follower, numbering)
        stopped = self.stopped_error(sender, run)
        return EventStreamResponse(
            stream_,
            job_id,
            stall_timeout_s=self.settings.stream_stall_timeout_s,
            on_stop=lambda: numbering.error(stopped),
        )

    async def cancel(self, response_id: str, identity: Identity) -> Response:
        job_id = job_id_of(response_id)
        stored, _ = await self._load(job_id, identity)
        await self.state.jobs.cancel(job_id, identity, "cancelled by its client")
        deadline = time.monotonic() + CANCEL_WAIT_S
        while True:
            view = await self.state.jobs.get(job_id, identity)
            if view.status != "running" or time.monotonic() > deadline:
                return JSONResponse(response_body(stored, outcome_of(view)))
            await asyncio.sleep(0.05)

    async def delete(self, response_id: str, identity: Identity) -> Response:
        """Forget the response: its stored conversation and parameters go (the id is a 404
        from now on); a response still running is cancelled first. The job's own record
        stays at /v1/jobs/{id} until its retention ends."""
        job_id = job_id_of(response_id)
        _, view = await self._load(job_id, identity)
        if view.status in ("queued", "running"):
            with contextlib.suppress(GenqError):
                await self.state.jobs.cancel(job_id, identity, "response deleted")
        await self.state.redis.delete(self.state.keys.response(job_id))
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # ---- stored context --------------------------------------------------------------------

    async def _store(self, job_id: str, stored: Stored) -> None:
        ttl = CONTEXT_TTL_RETENTIONS * self.settings.retention_s
        await self.state.redis.set(self.state.keys.response(job_id), stored.encode(), ex=ttl)

    async def _load(self, job_id: str, identity: Identity) -> tuple[Stored, JobView]:
        """The response's stored context and its job; 404 for one not stored (or gone) and
        for another owner's (the job's own check). An ended job's context expires with it."""
        state = self.state
        try:
            view = await state.jobs.get(job_id, identity)  # 404 for another owner's
        except NotFound:
            raise not_found(RESPONSE_PREFIX + job_id) from None
        key = state.keys.response(job_id)
        raw = await state.redis.get(key)
        if raw is None:
            raise not_found(RESPONSE_PREFIX + job_id)
        stored = Stored.decode(raw)
        if stored.owner != identity.owner and not identity.admin:
            raise not_found(RESPONSE_PREFIX + job_id)
        with contextlib.suppress(RedisError):
            if view.finished_at is None:  # still to run: as long again from now
                await state.redis.expire(key, CONTEXT_TTL_RETENTIONS * self.settings.retention_s)
            elif (left := await state.redis.pttl(state.keys.job(job_id))) > 0:
                await state.redis.pexpire(key, left)  # goes with the job's record
        return stored, view

    async def _history(self, previous_id: str, identity: Identity) -> list[dict[str, Any]]:
        """The conversation a response carries on from: the previous one's messages and its
        answer (text and tool calls) as the assistant's turn."""
        try:
            stored, view = await self._load(job_id_of(previous_id), identity)
        except NotFound:
            raise NotFound(
                f"no response '{previous_id[:80]}' (unknown, expired, deleted or not stored)",
                param="previous_response_id",
            ) from None
        o = outcome_of(view)
        if o.status not in ("completed", "incomplete"):
            raise BadRequest(
                f"previous response '{previous_id[:80]}' is {o.status}: a conversation carries "
                "on from a completed one",
                param="previous_response_id",
            )
        answer: dict[str, Any] = {"role": "assistant", "content": None}
        calls = []
        for item in _output(o, True):
            if item["type"] == "message":
                answer["content"] = item["content"][0]["text"] if item["content"] else ""
            else:
                calls.append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                )
        if calls:
            answer["tool_calls"] = calls
        return [*stored.messages, answer]

    # ---- following the job -----------------------------------------------------------------

    async def _wait(
        self, request: Request, sender: Sender, run: RequestState, followers: list[EventFollower]
    ) -> bool:
        """Until the job ends (True), or the client goes (False: the job is cancelled, as a
        chat completion's is); a 503 `server_stopping` if the gateway stops first."""

        async def drain() -> None:
            async for _ in merged(followers):
                pass

        follow = asyncio.create_task(drain())
        gone = asyncio.create_task(disconnected(request))
        stopping = asyncio.create_task(self.state.stopping.wait_end())
        try:
            await asyncio.wait({follow, gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            with anyio.CancelScope(shield=True):
                await stop_tasks([follow, gone, stopping])
                if follow.done() and not follow.cancelled() and follow.exception() is None:
                    for c in run.choices:
                        c.finish_reason = c.finish_reason or "ended"
                await self._close(sender, run, followers)
        if follow.cancelled() and not stopping.cancelled():
            stopped = self.stopped_error(sender, run)
            raise Unavailable(stopped.message, code=stopped.code)
        if follow.cancelled():
            return False
        follow.result()
        return True

    async def _events(
        self,
        sender: Sender,
        run: RequestState,
        follower: EventFollower,
        numbering: EventNumbering,
    ) -> AsyncIterator[bytes]:
        try:
            yield numbering.created()
            async for _, batch in merged([follower]):
                if batch is None:
                    yield KEEPALIVE
                    continue
                out = []
                for _seq, etype, data in batch:
                    if etype == "started":
                        out.append(numbering.opening())
                        continue
                    if etype not in _ENDING and etype != "token":
                        continue
                    ev = events.decode(data)
                    if isinstance(ev, TokenEvent):
                        out.append(numbering.token(ev))
                    elif isinstance(ev, DoneEvent | ErrorEvent | CancelledEvent):
                        out.append(numbering.end(ev))
                        run.choices[0].finish_reason = "ended"
                if out:
                    yield b"".join(out)
                if numbering.ended:
                    return
            lost = ErrorEvent(
                seq=10**9, attempt=0, code="job_lost", message="the job ended without a result"
            )
            yield numbering.end(lost)
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(sender, run, [follower])


_ENDING = frozenset({"done", "error", "cancelled"})
