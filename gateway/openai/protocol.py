"""OpenAI wire types: request bodies of /v1/completions and /v1/chat/completions, responses,
stream chunks, errors.

Request bodies accept fields they do not know (newer SDKs send more than we implement) and
ignore them with a debug log, as vLLM does. Known OpenAI fields that genq cannot honour
(`tools`, `echo`, …) are declared so that setting them gets a clear 400 rather
than being silently dropped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    SerializerFunctionWrapHandler,
    create_model,
    model_serializer,
    model_validator,
)

from gateway.http_errors import ErrorDetail
from shared.constraints import SchemaCheck
from shared.keys import Priority
from shared.schemas import (
    JSON_INTEGER,
    MAX_MODEL_NAME_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ONE_CONSTRAINT,
    SAMPLING_FIELDS,
    SCHEMA_STRICT_DOC,
    Logprobs,
    MaxTokens,
    Sampling,
    TimeoutS,
    TokenId,
    check_unicode,
)

log = logging.getLogger(__name__)

MAX_NAME_CHARS = MAX_MODEL_NAME_CHARS
MAX_CHAT_MESSAGES = 10_000
"""Most messages in one chat request; a body over it is counted and refused before it is parsed
(gateway/body_scan.py): 200,000 messages cost ~20 ms of the event loop, not the
~250 ms of `json.loads` and pydantic."""

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
PromptField = (
    Text
    | Annotated[list[Text], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)
"""One prompt or several, as text or token ids; none of them empty."""


_NOT_SUPPORTED = "not supported by genq: absent, or its neutral value (anything else is a 400)"
_TOP_LOGPROBS_NEED_LOGPROBS: dict[str, Any] = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}
"""The API document says what the 400 says: `top_logprobs` needs `logprobs: true`."""


class OpenAIRequest(BaseModel):
    """Base of request bodies: unknown fields are accepted, ignored and logged (debug)."""

    # strict: JSON's types as the API document writes them (`"top_p": true` is refused)
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _log_ignored(self) -> OpenAIRequest:
        if self.model_extra:
            log.debug("ignoring unknown request fields", extra={"fields": sorted(self.model_extra)})
        return self


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class _OpenAIParams(OpenAIRequest):
    """The fields both endpoints share that OpenAI defines its own way (`temperature`'s range,
    `stop` as one string or several), and genq's own (`priority`, `timeout_s`)."""

    @model_validator(mode="wrap")
    @classmethod
    def _unicode(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        return check_unicode(data, handler)

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    max_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    n: Annotated[int, Field(ge=1), JSON_INTEGER] = 1
    stop: Stop = None
    user: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    prompt_cache_key: str | None = Field(
        default=None,
        max_length=MAX_NAME_CHARS,
        description="keeps a conversation's jobs on one worker (its prefix cache) when the "
        "prompt alone does not tell",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Priority = "interactive"
    timeout_s: TimeoutS | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


CONVERTED = frozenset({"stop", "logprobs"})
"""Sampler settings an OpenAI body carries in a shape of its own: `stop` (`stop_list`), and
`logprobs`, which each endpoint declares (an integer, or chat's `logprobs` and
`top_logprobs`)."""
AS_IS: tuple[str, ...] = tuple(f for f in SAMPLING_FIELDS if f not in CONVERTED)
"""Sampler settings an OpenAI body carries under the native name, in the native type (within
OpenAI's range, where narrower): the job takes them as they are, when given."""


def _optional(name: str) -> tuple[Any, Any]:
    """Sampling's field `name` as an OpenAI body field: its type, limits and schema, absent
    (None) by default, so the job keeps the native default."""
    info = Sampling.model_fields[name]
    described: list[Any] = []
    if info.description or info.json_schema_extra:
        described = [Field(description=info.description, json_schema_extra=info.json_schema_extra)]
    extras = [*info.metadata, *described]
    constrained: Any = Annotated[info.annotation, *extras] if extras else info.annotation
    return (constrained | None, None)


_DERIVED = {f: _optional(f) for f in AS_IS if f not in _OpenAIParams.model_fields}

if TYPE_CHECKING:
    SamplingParams = _OpenAIParams
else:
    SamplingParams = create_model(
        "SamplingParams",
        __base__=_OpenAIParams,
        __module__=__name__,
        __doc__="""The fields both endpoints share: OpenAI's, genq's own, then every native
        sampler setting (`shared.schemas.Sampling`) with the native API's limits.""",
        **_DERIVED,
    )


class NativeConstraints(OpenAIRequest):
    """genq's own constraint fields, as the native API takes them (one at most)."""

    json_schema: dict[str, Any] | None = Field(
        default=None, description="genq: constrain the output to JSON valid under this schema"
    )
    json_schema_strict: bool | None = Field(default=None, description=f"genq: {SCHEMA_STRICT_DOC}")
    regex: str | None = Field(
        default=None, min_length=1, description="genq: constrain the output to this regex"
    )
    grammar: str | None = Field(
        default=None,
        min_length=1,
        description="genq: constrain the output to this Lark grammar (llguidance's dialect)",
    )


class CompletionRequest(NativeConstraints, SamplingParams):
    """Body of `POST /v1/completions`: one prompt or several, as text or token ids."""

    model_config = ConfigDict(json_schema_extra=ONE_CONSTRAINT)

    prompt: PromptField
    logprobs: Logprobs | None = None
    echo: bool = Field(
        default=False, json_schema_extra={"const": False}, description=_NOT_SUPPORTED
    )
    best_of: Annotated[int, Field(ge=1), JSON_INTEGER] | None = Field(
        default=None, description="must equal `n`, if given"
    )
    suffix: str | None = Field(
        default=None, json_schema_extra={"maxLength": 0}, description=_NOT_SUPPORTED
    )


class ContentPart(OpenAIRequest):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; fields beyond these (`tool_calls`, …) pass through to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(NativeConstraints, SamplingParams):
    """Body of `POST /v1/chat/completions`: the native constraint fields too (a reply under
    one of them is plain content, as under `response_format`)."""

    model_config = ConfigDict(json_schema_extra={**_TOP_LOGPROBS_NEED_LOGPROBS, **ONE_CONSTRAINT})

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    """vLLM's extension: False leaves the reply turn unopened."""
    tools: list[dict[str, Any]] | None = Field(
        default=None,
        max_length=128,
        description="functions the model may call (`{type: function, function: {name, "
        "description, parameters, strict}}`), in the model's own tool-call format",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        default=None,
        description="`none`, `auto` (the default with tools), `required`, or "
        "`{type: function, function: {name}}`",
    )
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
            "required": ["type"],
        },
        description='`{"type": "text"}`, `{"type": "json_object"}` or `{"type": '
        '"json_schema", "json_schema": {"name", "schema", "strict"}}`: the reply is JSON '
        "(valid under the schema)",
    )

    @property
    def completion_limit(self) -> int | None:
        """`max_completion_tokens` (the current name) wins over `max_tokens` (deprecated)."""
        return self.max_completion_tokens or self.max_tokens


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class SchemaChecked(BaseModel):
    """A choice that may carry `genq_schema` (only where its job was under a JSON schema)."""

    genq_schema: SchemaCheck | None = Field(
        default=None,
        description="genq: once the choice ended, its output checked against the whole JSON "
        "schema (`valid`: true, false, or null where not checked; `errors`)",
    )

    @model_serializer(mode="wrap")
    def _omit_no_schema(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("genq_schema") is None:
            out.pop("genq_schema", None)
        return out


class CompletionChoice(SchemaChecked):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(SchemaChecked):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    """A chunk's delta: only what it carries (`{"content": …}`, `{"tool_calls": …}`, or `{}`);
    the first, with the role, says its content as OpenAI's does: `""` before text, `null`
    before tool calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = {k: v for k, v in handler(self).items() if v is not None}
        if self.role is not None:
            out.setdefault("content", None)
        return out


class ChatChunkChoice(SchemaChecked):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ErrorResponse(BaseModel):
    """An error, as a body or as a stream frame (the SDK raises `APIError` on one)."""

    error: ErrorDetail
