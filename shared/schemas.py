"""The data of a job as clients and workers see it: HTTP bodies (what to run, what came of
it), the job's spec, results, and the model card. JSON produced and parsed by these pydantic
models; nothing is pickled. Events are in `shared.events`, Redis values in `shared.records`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    model_validator,
)
from pydantic_core import PydanticCustomError

from shared.constraints import CONSTRAINT_KINDS, Constraint, ConstraintKind, SchemaCheck
from shared.errors import escaped
from shared.keys import Priority

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "expired"})
FinishReason = Literal["stop", "length"]

MAX_SEED = 2**53 - 1
"""The largest integer JSON carries between implementations exactly (RFC 8259, section 6):
a browser's or an OpenAPI tool's double holds no larger one."""
MAX_TOKENS_CAP = 1_000_000
MAX_STOP_CHARS = 512
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
"""Most entries of a job's `logit_bias`: room for any ban list a client writes, while what a
job carries through the queue stays small."""
MAX_BIAS = 100.0
MAX_LOGPROBS = 20
MAX_TOP_K = 100_000
MAX_REPETITION_PENALTY = 10.0
MAX_TIMEOUT_S = 7 * 86_400
"""Limits of the sampler fields, shared by the native and the OpenAI-compatible API."""
MAX_MODEL_NAME_CHARS = 256
MAX_METADATA_DEPTH = 32
"""Deepest nesting of a job's metadata (its size is GENQ_MAX_METADATA_BYTES)."""


# Fields both APIs take, with the native API's limits (the OpenAI routes accept them too, as
# vLLM and tabbyAPI clients send them in `extra_body`).
def _json_integer(v: Any) -> Any:
    """JSON Schema counts `5.0` an integer (the API document's `integer` takes it): an integral
    float becomes that int; `true`, `"5"` and `5.5` stay refused (strict)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


JSON_INTEGER = BeforeValidator(_json_integer)
"""The last item of every request body's `Annotated[int, Field(<limits>), JSON_INTEGER]`: after
the limits, or the API document would lose them (pydantic writes `ge`, not `minimum`)."""
TokenId = Annotated[int, Field(ge=0), JSON_INTEGER]
TopK = Annotated[int, Field(ge=0, le=MAX_TOP_K, description="0 = off"), JSON_INTEGER]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED), JSON_INTEGER]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_CAP), JSON_INTEGER]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), JSON_INTEGER]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY)]
StopTokenIds = Annotated[
    list[TokenId],
    Field(
        max_length=MAX_STOP_TOKEN_IDS,
        description="token ids that end the job (each within the model's vocabulary)",
    ),
]
TOKEN_ID_KEY = "^(0|[1-9][0-9]{0,9})$"
"""A key of `logit_bias`: OpenAI's shape, a token id written in decimal (`"50256"`): no sign,
no leading zero, so each token has one key."""


_TOKEN_ID_KEY = re.compile(TOKEN_ID_KEY)


def _token_id_key(key: str) -> str:
    if not _TOKEN_ID_KEY.fullmatch(key):
        raise PydanticCustomError(
            "token_id_key", 'not a token id: its keys are token ids in decimal, as "50256"'
        )
    return key


TokenIdKey = Annotated[
    str, AfterValidator(_token_id_key), Field(json_schema_extra={"pattern": TOKEN_ID_KEY})
]
LogitBias = Annotated[
    dict[TokenIdKey, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]],
    Field(
        max_length=MAX_LOGIT_BIAS,
        json_schema_extra={"additionalProperties": False},
        description="token id (decimal string) → bias added to its logit before sampling: "
        "-100 bans it, 100 all but forces it (each id within the model's vocabulary)",
    ),
]
BannedStrings = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
    Field(
        max_length=MAX_STOP_STRINGS,
        description="strings the output never contains (matched without regard to case)",
    ),
]
MinTokens = Annotated[
    int,
    Field(
        ge=0,
        le=MAX_TOKENS_CAP,
        description="no stop token (EOS included) ends the job before this many tokens "
        "(stop strings still do); at most max_tokens",
    ),
    JSON_INTEGER,
]
TimeoutS = Annotated[
    float, Field(gt=0, le=MAX_TIMEOUT_S, description="deadline from submission; then `expired`")
]


M = TypeVar("M", bound=BaseModel)


def check_unicode(data: Any, handler: ModelWrapValidatorHandler[M]) -> M:
    """A `mode="wrap"` check of a whole request body: a JSON string may hold a lone surrogate
    (`"\\ud800"`), which is no character and cannot be encoded; refuse it, naming the field
    (in the error's ctx `param`). The fields are validated first, so a body they refuse (200,000
    messages) costs no encode; then one C-speed encode of the body, and a walk only when that
    fails."""
    model = handler(data)
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        path = _surrogate_path(data)
        raise PydanticCustomError(
            "invalid_unicode",
            "holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not a character",
            {"param": path},
        ) from None
    except (ValueError, TypeError, RecursionError):
        pass  # not JSON-shaped (a model built in code), or too deep: JSON never holds those
    return model


def _surrogate_path(value: Any, path: str = "") -> str:
    """Where in `value` a string that does not encode as UTF-8 is (`messages.3.content`)."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(v, dict):
            stack += [(_join(where, k), k) for k in v]
            stack += [(_join(where, k), x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(_join(where, str(i)), x) for i, x in enumerate(v)]
    return path or "body"


def _join(where: str, key: object) -> str:
    name = escaped(str(key))
    return f"{where}.{name}" if where else name


def json_depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (a scalar: 0)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack += [(c, depth + 1) for c in children]
    return deepest


class Sampling(BaseModel):
    """Sampler settings. Neutral defaults: an engine sets every one of them explicitly."""

    # strict: JSON's types as the API document writes them (lax pydantic takes `true` for a
    # number and `"5"` for an integer)
    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(default=1.0, ge=0.0, le=10.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: Seed | None = None
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    logprobs: Logprobs | None = Field(default=None, description="top-N logprobs per token")
    logit_bias: LogitBias = Field(default_factory=dict)
    min_tokens: MinTokens = 0
    banned_strings: BannedStrings = Field(default_factory=list)

    @classmethod
    def of(cls, body: BaseModel) -> Sampling:
        """The sampler settings a request body carries (a `JobCreate`), as a `Sampling` of
        their own (lists copied)."""
        return cls.model_validate({name: getattr(body, name) for name in SAMPLING_FIELDS})

    def changed(self) -> list[str]:
        """The fields set off their defaults, in field order."""
        return [name for name in SAMPLING_FIELDS if getattr(self, name) != SAMPLING_DEFAULTS[name]]


SAMPLING_FIELDS: tuple[str, ...] = tuple(Sampling.model_fields)
"""The sampler settings by name, in order: the one list of them. The native body (a
subclass), the OpenAI bodies (`gateway.openai.protocol`), the job's spec, the engine
process's wire struct (`worker.wire`) and every copy between them are made from it; each
engine's mapping to its library is tested against it (`worker.engine.SamplingSupport`)."""
SAMPLING_FIELD_SET = frozenset(SAMPLING_FIELDS)
SAMPLING_DEFAULTS: dict[str, Any] = {
    name: info.get_default(call_default_factory=True)
    for name, info in Sampling.model_fields.items()
}
"""Each sampler setting's neutral value: the engine does nothing for it."""


_GIVEN: dict[str, dict[str, Any]] = {
    "json_schema": {"type": "object"},
    "regex": {"type": "string"},
    "grammar": {"type": "string"},
}
ONE_CONSTRAINT: dict[str, Any] = {
    "not": {
        "anyOf": [
            {"required": [a, b], "properties": {a: _GIVEN[a], b: _GIVEN[b]}}
            for a, b in (("json_schema", "regex"), ("json_schema", "grammar"), ("regex", "grammar"))
        ]
    },
    "anyOf": [
        {"not": {"required": ["json_schema_strict"]}},
        {"properties": {"json_schema_strict": {"type": "null"}}},
        {"required": ["json_schema"], "properties": {"json_schema": _GIVEN["json_schema"]}},
    ],
}
"""JSON Schema for "one constraint at most" and "`json_schema_strict` only beside a
`json_schema`" (a null one is none): the API document says it."""
_ONE_INPUT: dict[str, Any] = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
    ],
    **ONE_CONSTRAINT,
}
"""JSON Schema for "exactly one of prompt and input_ids": the API document says it too."""


SCHEMA_STRICT_DOC = (
    "with json_schema: true (the default) refuses a schema keyword the grammar cannot "
    "enforce (a 400 naming its path); false enforces the rest, lists what it leaves out in "
    "the job's constraint (`unenforced`) and checks the finished output against the whole "
    "schema (`schema_check`)"
)
"""The native `json_schema_strict` field, on every route that takes `json_schema`."""


MAX_WEBHOOK_URL_CHARS = 2048
JobEventType = Literal["job.succeeded", "job.failed", "job.cancelled", "job.expired"]


class WebhookTarget(BaseModel):
    """Where a job's end is told (shared/webhooks.py): a URL, and the job events wanted."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(
        min_length=1,
        max_length=MAX_WEBHOOK_URL_CHARS,
        pattern=r"^https?://[^\s/?#]+[^\s]*$",
        description="https (http only where GENQ_WEBHOOK_ALLOW_HTTP); never a private, "
        "loopback or link-local address unless GENQ_WEBHOOK_ALLOW_HOSTS names it",
    )
    events: list[JobEventType] | None = Field(
        default=None, min_length=1, description="the job events to send (all four by default)"
    )

    def wants(self, kind: str) -> bool:
        return self.events is None or kind in self.events


class JobCreate(Sampling):
    """Body of `POST /v1/jobs`: exactly one of `prompt` and `input_ids`."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_INPUT)

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    prompt: str | None = Field(default=None, min_length=1, description="text; or give input_ids")
    input_ids: list[TokenId] | None = Field(
        default=None, min_length=1, description="token ids (each within the model's vocabulary)"
    )
    max_tokens: MaxTokens | None = None
    priority: Priority = "interactive"
    metadata: dict[str, Any] = Field(default_factory=dict)
    stream: bool = Field(default=False, description="answer with the job's SSE stream")
    cancel_on_disconnect: bool = Field(
        default=False, description="with `stream`: a client that disconnects cancels the job"
    )
    timeout_s: TimeoutS | None = None
    webhook: WebhookTarget | None = Field(
        default=None,
        description="told when the job ends: a signed `job.succeeded`, `job.failed`, "
        "`job.cancelled` or `job.expired` event (at least once, the same event id each time)",
    )
    json_schema: dict[str, Any] | None = Field(
        default=None, description="constraint: the output is JSON valid under this schema"
    )
    json_schema_strict: bool | None = Field(default=None, description=SCHEMA_STRICT_DOC)
    regex: str | None = Field(
        default=None, min_length=1, description="constraint: the output matches this regex"
    )
    grammar: str | None = Field(
        default=None,
        min_length=1,
        description="constraint: the output is in this Lark grammar (llguidance's dialect)",
    )

    @model_validator(mode="wrap")
    @classmethod
    def _unicode(cls, data: Any, handler: ModelWrapValidatorHandler[JobCreate]) -> JobCreate:
        return check_unicode(data, handler)

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.prompt is None) == (self.input_ids is None):
            param = "prompt" if self.prompt is None else "input_ids"
            raise PydanticCustomError(
                "one_input", "give exactly one of `prompt` and `input_ids`", {"param": param}
            )
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise PydanticCustomError(
                "one_constraint", "{message}", {"param": given[-1], "message": one_only(given)}
            )
        if self.json_schema_strict is not None and self.json_schema is None:
            raise PydanticCustomError(
                "strict_alone",
                "json_schema_strict goes with json_schema, which is not given",
                {"param": "json_schema_strict"},
            )
        return self

    def constraint(self) -> tuple[ConstraintKind, Any] | None:
        """The constraint field given, and its value (one at most)."""
        for kind in CONSTRAINT_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None


def one_only(given: Sequence[str]) -> str:
    """What a request that gives several constraints is told (they name the fields given)."""
    both = "both" if len(given) == 2 else "all"
    return f"give one constraint at most: {_and(given)} were {both} given"


def _and(names: Sequence[str]) -> str:
    """`a and b`, `a, b and c`."""
    return " and ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


class JobSpec(BaseModel):
    """What a worker needs to run a job; stored in the job record as `spec`."""

    id: str
    model: str
    input_ids: list[int]
    max_tokens: int
    sampling: Sampling
    priority: Priority
    created_at: float
    deadline: float | None = None
    add_bos: bool = False
    constraint: Constraint | None = None
    followed: bool = False
    """Submitted by a client that follows it as it runs (a stream, or a request waiting for
    its answer): once no client does, nobody waits on it, and a stop hands it back at once
    (worker/drain.py). Batch lines, background responses and jobs submitted without a stream
    are wanted whether or not anyone watches."""


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0


class Timings(BaseModel):
    queue_s: float | None = None
    ttft_s: float | None = None
    generation_s: float | None = None


class ErrorInfo(BaseModel):
    code: str
    message: str


# ---- results ------------------------------------------------------------------------------


class JobResult(BaseModel):
    """What a job generated: all of it (succeeded), or what it had when it was cancelled or
    expired (`finish_reason` None: it did not finish; the job's status says why)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    schema_check: SchemaCheck | None = None
    """Under a JSON schema, once it succeeded: the output checked against the whole schema."""


class JobView(BaseModel):
    """Body of `GET /v1/jobs/{id}` (and of the 202 answering a submission)."""

    id: str
    status: JobStatus
    model: str
    priority: Priority
    attempt: int = 0
    worker: str | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    text: str | None = Field(
        default=None,
        description="the text generated: all of it once succeeded; what there was when it "
        "was cancelled or expired; so far, while it runs",
    )
    text_truncated: bool = Field(
        default=False,
        description="true when `text` is not the whole text so far (a running job's text "
        "is read from its event log, up to a limit)",
    )
    finish_reason: FinishReason | None = Field(
        default=None, description="why generation stopped; set once the job succeeded"
    )
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    cancel_requested: bool = Field(
        default=False,
        description="a cancel was asked for and the worker running the job has not yet stopped it",
    )
    metadata: dict[str, Any] = Field(default_factory=dict)
    constraint: dict[str, Any] | None = Field(
        default=None,
        description="the job's constraint, if any: `type` (json_schema, regex or grammar) "
        "and its value under that name; `origin` when an OpenAI field made it "
        "(response_format, tools); for a JSON schema, `strict` and `unenforced` (paths of "
        "the keywords its grammar does not enforce)",
    )
    schema_check: SchemaCheck | None = Field(
        default=None,
        description="under a JSON schema, once the job succeeded: `valid` (the output "
        "checked against the whole schema; null where it was not checked) and `errors`",
    )


# ---- models -------------------------------------------------------------------------------


class ModelCard(BaseModel):
    """What a worker publishes about its model; the gateway tokenizes and validates with it."""

    name: str
    engine: str
    simulated: bool = False
    max_seq_len: int
    max_batch: int
    tokenizer_sha: str
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: list[int] = Field(default_factory=list)
    add_bos: bool = False
    chat_template: str | None = None
    description: str = ""
