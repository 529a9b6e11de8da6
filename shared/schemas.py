"""The data of a job as clients and workers see it: HTTP bodies (what to run, what came of
it), the job's spec, results, and the model card. JSON produced and parsed by these pydantic
models; nothing is pickled. Events are in `shared.events`, Redis values in `shared.records`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.keys import Priority

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "expired"})
FinishReason = Literal["stop", "length"]

MAX_SEED = 2**63 - 1
MAX_TOKENS_CAP = 1_000_000
MAX_STOP_CHARS = 512
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
"""Limits of the sampler fields, shared by the native and the OpenAI-compatible API."""


class Sampling(BaseModel):
    """Sampler settings. Neutral defaults: an engine sets every one of them explicitly."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=10.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=100_000, description="0 = off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS
    )
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="top-N logprobs per token"
    )


class JobCreate(Sampling):
    """Body of `POST /v1/jobs`."""

    model: str = Field(min_length=1, max_length=256)
    prompt: str | None = Field(default=None, description="text; or give input_ids")
    input_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    priority: Priority = "interactive"
    metadata: dict[str, Any] = Field(default_factory=dict)
    stream: bool = Field(default=False, description="answer with the job's SSE stream")
    cancel_on_disconnect: bool = Field(
        default=False, description="with `stream`: a client that disconnects cancels the job"
    )
    timeout_s: float | None = Field(
        default=None, gt=0, le=7 * 86_400, description="deadline from submission; then `expired`"
    )

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `prompt` and `input_ids`")
        return self


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
