"""From job events to OpenAI output: each choice's state, and the chat / completion shapes of
its chunks and of the final response."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from gateway.http_errors import ErrorDetail
from gateway.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionDelta,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    UsageInfo,
)
from gateway.openai.toolcalls import CallDelta, ToolCallReader, ToolFormat, tool_format_of
from shared.constraints import CONSTRAINT_FAILED, Constraint, SchemaCheck
from shared.events import CancelledEvent, DoneEvent, ErrorEvent, Event, TokenEvent
from shared.schemas import Usage


@dataclass(slots=True)
class ChoiceState:
    """One choice = one job: what its events have said so far."""

    index: int
    job_id: str
    prompt_index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    failure: ErrorDetail | None = None
    constraint_param: str | None = None
    """The request field its job's constraint came from (`regex`, `response_format`, …): the
    `param` of the error when that constraint could not run."""
    schema_check: SchemaCheck | None = None

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.failure is not None

    def apply(self, ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            self.text.append(ev.text)
            if ev.logprobs:
                self.logprobs = (self.logprobs or []) + ev.logprobs
        elif isinstance(ev, DoneEvent):
            self.finish_reason, self.usage = ev.finish_reason, ev.usage
            self.schema_check = ev.schema_check
        elif isinstance(ev, ErrorEvent) and ev.code == CONSTRAINT_FAILED:  # the request's fault
            self.failure = ErrorDetail(
                message=ev.message,
                type="invalid_request_error",
                param=self.constraint_param,
                code=ev.code,
            )
        elif isinstance(ev, ErrorEvent):
            self.failure = ErrorDetail(message=ev.message, type="server_error", code=ev.code)
        elif isinstance(ev, CancelledEvent):
            self.failure = ErrorDetail(
                message=f"job {self.job_id} was cancelled: {ev.reason}",
                type="server_error",
                code="cancelled",
            )


@dataclass(slots=True)
class RequestState:
    """One OpenAI request: its id, its model, and its choices (jobs), in index order."""

    id: str
    created: int
    model: str
    choices: list[ChoiceState]
    prompt_tokens: list[int]
    """Per prompt: counted once however many choices (n) it has."""

    def usage(self) -> UsageInfo:
        completion = sum(c.usage.completion_tokens for c in self.choices if c.usage)
        firsts = {c.prompt_index: c for c in reversed(self.choices)}
        cached = sum(c.usage.cached_tokens for c in firsts.values() if c.usage)
        prompt = sum(self.prompt_tokens)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class OutputFormat(Protocol):
    """What differs between /v1/chat/completions and /v1/completions output."""

    def opening(self, run: RequestState) -> list[BaseModel]: ...

    def token_chunk(
        self, run: RequestState, choice: ChoiceState, ev: TokenEvent
    ) -> BaseModel | None: ...

    def final_chunk(self, run: RequestState, choice: ChoiceState) -> BaseModel: ...

    def usage_chunk(self, run: RequestState) -> BaseModel: ...

    def response(self, run: RequestState) -> BaseModel: ...


def _top(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return list(entry.get("top_logprobs") or [])


class ChatFormat:
    """`tools`: the tool-call format of a request under a tools constraint (its output is
    read back as content and `tool_calls`, gateway/openai/toolcalls.py), else None."""

    def __init__(self, want_logprobs: bool, tools: ToolFormat | None = None) -> None:
        self.want_logprobs = want_logprobs
        self.tools = tools
        self._readers: dict[int, ToolCallReader] = {}
        """Per choice, while it streams."""

    @classmethod
    def of(cls, want_logprobs: bool, constraint: Constraint | None) -> ChatFormat:
        """For a job (or request) under `constraint`: its tools' format, when it has one."""
        return cls(want_logprobs, tool_format_of(constraint))

    def _reader(self, index: int) -> ToolCallReader | None:
        if self.tools is None:
            return None
        return self._readers.setdefault(index, ToolCallReader(self.tools))

    def _logprobs(self, entries: list[dict[str, Any]] | None) -> ChatLogprobs | None:
        if not self.want_logprobs or entries is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=e["token"],
                    logprob=e["logprob"],
                    bytes=list(e["token"].encode()),
                    top_logprobs=[
                        TopLogprob(
                            token=t["token"], logprob=t["logprob"], bytes=list(t["token"].encode())
                        )
                        for t in _top(e)
                    ],
                )
                for e in entries
            ]
        )

    def _chunk(self, run: RequestState, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=run.id, created=run.created, model=run.model, choices=choices)

    def opening(self, run: RequestState) -> list[BaseModel]:
        """The role delta, first, for every choice: content `""` (OpenAI's before text), or
        under tools `null` (OpenAI's before tool calls; text that comes instead follows it)."""
        content = None if self.tools is not None else ""
        delta = ChatDelta(role="assistant", content=content)
        return [
            self._chunk(run, [ChatChunkChoice(index=c.index, delta=delta)]) for c in run.choices
        ]

    def token_chunk(
        self, run: RequestState, choice: ChoiceState, ev: TokenEvent
    ) -> BaseModel | None:
        logprobs = self._logprobs(ev.logprobs)
        reader = self._reader(choice.index)
        if reader is None:
            if not ev.text and logprobs is None:
                return None
            delta = ChatDelta(content=ev.text)
        else:
            text, calls = reader.feed(ev.text)
            if not text and not calls and logprobs is None:
                return None
            delta = ChatDelta(content=text or None, tool_calls=_call_deltas(calls) or None)
        return self._chunk(
            run, [ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs)]
        )

    def final_chunk(self, run: RequestState, choice: ChoiceState) -> BaseModel:
        reader = self._reader(choice.index)
        rest = reader.finish() if reader is not None else ""
        reason = choice.finish_reason
        if reader is not None and reader.calls and reason == "stop":
            reason = "tool_calls"
        last = ChatChunkChoice(
            index=choice.index,
            delta=ChatDelta(content=rest or None),
            finish_reason=reason,
            genq_schema=choice.schema_check,
        )
        return self._chunk(run, [last])

    def usage_chunk(self, run: RequestState) -> BaseModel:
        return _with_usage(self._chunk(run, []), run)

    def response(self, run: RequestState) -> BaseModel:
        choices = [self._choice(c) for c in run.choices]
        return ChatCompletionResponse(
            id=run.id, created=run.created, model=run.model, choices=choices, usage=run.usage()
        )

    def _choice(self, c: ChoiceState) -> ChatChoice:
        text, reason = "".join(c.text), c.finish_reason
        message = ChatMessageOut(content=text)
        if self.tools is not None:
            reader = ToolCallReader(self.tools)
            content, _ = reader.feed(text)
            content += reader.finish()
            message = ChatMessageOut(
                content=content or None,
                tool_calls=[ToolCall.model_validate(call) for call in reader.calls] or None,
            )
            if reader.calls and reason == "stop":
                reason = "tool_calls"
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=self._logprobs(c.logprobs),
            finish_reason=reason,
            genq_schema=c.schema_check,
        )


def _call_deltas(calls: list[CallDelta]) -> list[ToolCallDelta]:
    return [
        ToolCallDelta(
            index=d.index,
            id=d.id,
            type="function" if d.id else None,
            function=FunctionDelta(name=d.name, arguments=d.arguments),
        )
        for d in calls
    ]


class CompletionFormat:
    def __init__(self, want_logprobs: bool) -> None:
        self.want_logprobs = want_logprobs
        self._offsets: dict[int, int] = {}
        """Per choice: characters of text already covered by streamed logprobs."""

    def _logprobs(
        self, index: int, entries: list[dict[str, Any]] | None
    ) -> CompletionLogprobs | None:
        if not self.want_logprobs or entries is None:
            return None
        out = CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        for e in entries:
            out.tokens.append(e["token"])
            out.token_logprobs.append(e["logprob"])
            out.top_logprobs.append({t["token"]: t["logprob"] for t in _top(e)})
            out.text_offset.append(offset)
            offset += len(e["token"])
        self._offsets[index] = offset
        return out

    def _chunk(self, run: RequestState, choices: list[CompletionChoice]) -> CompletionResponse:
        return CompletionResponse(id=run.id, created=run.created, model=run.model, choices=choices)

    def opening(self, run: RequestState) -> list[BaseModel]:
        return []

    def token_chunk(
        self, run: RequestState, choice: ChoiceState, ev: TokenEvent
    ) -> BaseModel | None:
        logprobs = self._logprobs(choice.index, ev.logprobs)
        if not ev.text and logprobs is None:
            return None
        return self._chunk(
            run, [CompletionChoice(index=choice.index, text=ev.text, logprobs=logprobs)]
        )

    def final_chunk(self, run: RequestState, choice: ChoiceState) -> BaseModel:
        last = CompletionChoice(
            index=choice.index,
            text="",
            finish_reason=choice.finish_reason,
            genq_schema=choice.schema_check,
        )
        return self._chunk(run, [last])

    def usage_chunk(self, run: RequestState) -> BaseModel:
        return _with_usage(self._chunk(run, []), run)

    def response(self, run: RequestState) -> BaseModel:
        choices = [
            CompletionChoice(
                index=c.index,
                text="".join(c.text),
                logprobs=self._logprobs(c.index, c.logprobs),
                finish_reason=c.finish_reason,
                genq_schema=c.schema_check,
            )
            for c in run.choices
        ]
        response = self._chunk(run, choices)
        response.usage = run.usage()
        return response


def _with_usage(chunk: ChatCompletionChunk | CompletionResponse, run: RequestState) -> BaseModel:
    """The closing usage-only chunk (`stream_options.include_usage`): no choices, the usage."""
    chunk.usage = run.usage()
    return chunk
