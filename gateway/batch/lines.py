"""One line of a batch input file, checked as the live endpoint checks a request body.

The checks are the live ones (gateway/openai/serving.py: `plan`, then `prepare_jobs` against
the model's card: template, tokenizer, context length), run at upload (so a bad file is
refused whole) and again when the line is queued (its job is built then). What the batch API
adds: a line is one job, so `n` is 1 and a completion has one prompt; and it is not streamed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError

from gateway.body_scan import Counter
from gateway.http_errors import field_of
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai.serving import Plan, plan, prepare_jobs, refuse
from gateway.state import GatewayState
from shared.batches import RequestLine
from shared.errors import GenqError
from shared.schemas import JobCreate, JobSpec

M = TypeVar("M", bound=BaseModel)
_BODIES: dict[str, type[CompletionRequest | ChatCompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
_COUNTERS = {url: Counter(model) for url, model in _BODIES.items()}


class _Addressed(msgspec.Struct):
    """What a line's lists are counted by: its url, and its body as raw bytes."""

    url: str | None = None
    body: msgspec.Raw = msgspec.Raw()


_ADDRESSED = msgspec.json.Decoder(_Addressed)


@dataclass(frozen=True, slots=True)
class LineProblem:
    """Why a line cannot run."""

    line: int
    param: str | None
    message: str
    code: str = "invalid_request"

    def describe(self) -> str:
        where = f"line {self.line}" + (f", {self.param}" if self.param else "")
        return f"{where}: {self.message}"


@dataclass(frozen=True, slots=True)
class PreparedLine:
    """A line that can run: its job, built (not yet queued)."""

    line: int
    request: RequestLine
    plan: Plan
    body: JobCreate
    spec: JobSpec


class _Refused(Exception):
    def __init__(self, param: str | None, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


class LineChecker:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def check(self, line: int, raw: bytes) -> PreparedLine | LineProblem:
        """The job line `line` (1-based; `raw` without its newline) asks for, or its problem."""
        try:
            _count_lists(raw)
            request = _request_line(raw)
            req = _validated(_BODIES[request.url], request.body, "body")
            p = _batch_plan(req)
            loaded = await self.state.registry.get(req.model)
            _, [(body, spec)] = await prepare_jobs(self.state, p, loaded, "batch")
        except _Refused as exc:
            return LineProblem(line, exc.param, exc.message, exc.code)
        except GenqError as exc:
            param = f"body.{exc.param}" if exc.param else "body"
            return LineProblem(line, param, exc.message, exc.code)
        return PreparedLine(line, request, p, body, spec)


def _count_lists(raw: bytes) -> None:
    """A body whose long list is over its limit (200,000 messages) is refused from a scan,
    before `json.loads` and pydantic build every item on the event loop."""
    try:
        line = _ADDRESSED.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return  # `_request_line` says what is wrong with it
    counter = _COUNTERS.get(line.url or "")
    if counter is not None and line.body:
        over = counter.first_too_long(line.body)
        if over is not None:
            raise _Refused(f"body.{over.field}", over.message, "invalid_value")


def _request_line(raw: bytes) -> RequestLine:
    try:
        obj: Any = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _Refused(None, "not UTF-8 text", "invalid_json") from None
    except json.JSONDecodeError as exc:
        raise _Refused(
            None, f"not JSON ({exc.msg} at column {exc.colno})", "invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise _Refused(None, "a line must be a JSON object (custom_id, method, url, body)")
    return _validated(RequestLine, obj, "")


def _validated(model: type[M], data: dict[str, Any], prefix: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        param = ".".join(x for x in (prefix, field_of(e)) if x) or None
        raise _Refused(param, str(e.get("msg", "invalid")), "invalid_value") from None


def _batch_plan(req: CompletionRequest | ChatCompletionRequest) -> Plan:
    """The live endpoint's plan, less what a batch line cannot be: streamed, or several jobs."""
    if req.stream:
        raise _Refused("body.stream", "batch requests are not streamed; leave out `stream`")
    if req.n != 1:
        raise _Refused("body.n", f"n is {req.n}; a batch line makes one completion (n = 1)")
    try:
        p = plan(req)
        refuse(p)
    except GenqError as exc:
        raise _Refused(
            f"body.{exc.param}" if exc.param else "body", exc.message, exc.code
        ) from None
    if len(p.prompts) > 1:
        raise _Refused(
            "body.prompt", f"{len(p.prompts)} prompts; a batch line holds one (one per line)"
        )
    return p


def custom_id_of(raw: bytes) -> str:
    """The custom_id a raw line gives, or '' where it gives none (for its error line)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return ""
    value = obj.get("custom_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) else ""
