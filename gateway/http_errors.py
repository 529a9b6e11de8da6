"""The one place errors become HTTP: `{"error": {"message", "type", "param", "code"}}`.

Every answer that is not a success has this shape: genq's own errors, FastAPI's validation
errors (422), Starlette's 404 and 405, bodies that do not parse, and Redis being away (503).
A `param` names the field as a person would write it (`messages.0.content`, `body`), never a
pydantic-internal name, and what a client sent is echoed cut and escaped.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from shared.errors import (
    SHOWN_CHARS,
    BadRequest,
    GenqError,
    MethodNotAllowed,
    NotFound,
    Unauthorized,
    escaped,
    shown,
)
from shared.redis_health import failure_level

log = logging.getLogger(__name__)
_CHALLENGE = {"WWW-Authenticate": "Bearer"}
"""On every 401 (RFC 9110): the scheme a client should answer with."""
_MAX_REPORTED = 8
"""Most validation errors one 422 message lists (a 10,000-item body can hold 10,000)."""
_UNION_TAG = re.compile(r"[^A-Za-z0-9_]|^(str|int|float|bool|none|list|dict|bytes)$")
"""A loc item pydantic adds for a union member (`constrained-str`, `list[int]`): no field name
looks like one."""
_LOC_ROOTS = frozenset({"body", "query", "header", "path", "cookie"})
_BOUNDS = frozenset(
    {"less_than", "less_than_equal", "greater_than", "greater_than_equal", "finite_number"}
)
"""pydantic's errors of a number out of its field's bounds."""

OPENAI_UNSERVED = frozenset(
    {
        "assistants",
        "audio",
        "chatkit",
        "containers",
        "conversations",
        "edits",
        "embeddings",
        "engines",
        "evals",
        "fine-tunes",
        "fine_tuning",
        "images",
        "moderations",
        "organization",
        "realtime",
        "threads",
        "uploads",
        "vector_stores",
        "videos",
    }
)
"""OpenAI API families genq does not serve: a request to one gets a 404 that says so."""


class ErrorDetail(BaseModel):
    """What `{"error": …}` holds, in every error answer and error stream frame."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


_MEANING = {
    400: "Invalid input: the message names the field and the limit",
    401: "Missing or invalid API key",
    404: "No such job, model or route",
    409: "Conflicts with the job's state (e.g. it already ended)",
    413: "Request body over GENQ_MAX_BODY_BYTES",
    422: "A field fails validation: the message names it and the limit",
    429: "Too many requests queued; retry after `Retry-After` seconds",
    503: "Redis or the model's workers are unavailable, or the gateway is draining",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with the error body's schema as JSON
    (written out, not as a `model`: FastAPI would give a model the route's media type, and an
    SSE route's errors are no event stream)."""
    schema = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": ErrorDetail.model_json_schema()},
    }
    content = {"application/json": {"schema": schema}}
    return {s: {"description": _MEANING[s], "content": content} for s in statuses}


SSE = "text/event-stream"


def sse_response(description: str, json_model: type[BaseModel] | None = None) -> dict[str, Any]:
    """OpenAPI for a 200 that is an SSE stream (or, with `json_model`, JSON when not streamed)."""
    doc: dict[str, Any] = {
        "description": description,
        "content": {SSE: {"schema": {"type": "string", "description": "SSE frames"}}},
    }
    if json_model is not None:
        doc["model"] = json_model
    return doc


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_RETRY_AFTER_S = 1
"""Retry-After of a Redis error: a restart or failover is over within seconds."""
OUT_OF_MEMORY = (
    "Redis is out of memory: at its maxmemory it refuses writes (maxmemory-policy "
    "noeviction), so no job can be queued or changed now; retry later"
)


def is_out_of_memory(exc: BaseException) -> bool:
    """An OOM reply: redis-py's OutOfMemoryError, or the same reply from inside a script."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and str(exc).startswith("OOM ")
    )


def error_response(exc: GenqError, headers: dict[str, str] | None = None) -> JSONResponse:
    """`exc` as its HTTP answer (also used by the middleware, outside the exception handlers)."""
    headers = dict(headers or {})
    if isinstance(exc, Unauthorized):
        headers = {**_CHALLENGE, **headers}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return JSONResponse(body, exc.status, headers=headers or None)


def _genq_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GenqError)
    return error_response(exc)


def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    """422 naming each bad field and its limit, e.g. `max_tokens: Input should be ≤ 1000000`."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return error_response(_invalid_json(errors[0]))
    by_field: dict[str, list[str]] = {}
    for e in errors:
        msgs = by_field.setdefault(_param(e), [])
        if (msg := _message(e)) not in msgs:
            msgs.append(msg)
    parts = [f"{field}: {' or '.join(msgs)}" for field, msgs in by_field.items()]
    if len(parts) > _MAX_REPORTED:
        parts = [*parts[:_MAX_REPORTED], f"and {len(parts) - _MAX_REPORTED} more"]
    first = next(iter(by_field), "body")
    body = error_body("; ".join(parts), "invalid_request_error", first, "invalid_value")
    body["detail"] = [
        {"loc": _clean_loc(e)[0], "msg": _message(e), "type": e.get("type")}
        for e in errors[:_MAX_REPORTED]
    ]
    return JSONResponse(body, 422)


def _message(e: Any) -> str:
    """pydantic's message, but for NaN and Infinity (Python's JSON reads them): pydantic
    measures them against the field's bounds and says "should be less than or equal to 2",
    which is not what is wrong."""
    value = e.get("input")
    if e.get("type") in _BOUNDS and isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, not {value}"
    return str(e.get("msg", "invalid"))


def _clean_loc(e: Any) -> tuple[list[str | int], str]:
    """The error's location without pydantic's union tags, each name cut and escaped; and
    where it is: body, query, header, path."""
    loc = list(e.get("loc", ()))
    root = str(loc.pop(0)) if loc and loc[0] in _LOC_ROOTS else "body"
    last = len(loc) - 1
    out: list[str | int] = []
    for i, x in enumerate(loc):
        if isinstance(x, int):
            out.append(x)
        elif (i == last and e.get("type") == "extra_forbidden") or not _UNION_TAG.search(x):
            out.append(escaped(x, SHOWN_CHARS))
    return out, root


def field_of(e: Any) -> str:
    """A pydantic error's field as a person wrote it (`prompt`, `messages.2.content`), or ''."""
    return ".".join(str(x) for x in _clean_loc(e)[0])


def _param(e: Any) -> str:
    ctx = e.get("ctx") or {}
    if isinstance(ctx.get("param"), str):  # a model-level check that names the field itself
        return str(ctx["param"])
    loc, root = _clean_loc(e)
    return ".".join(str(x) for x in loc) or root


def _invalid_json(e: Any) -> BadRequest:
    loc = e.get("loc", ())
    where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
    reason = (e.get("ctx") or {}).get("error", "invalid")
    return BadRequest(f"the body is not valid JSON: {reason}{where}", param="body")


def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's and FastAPI's own HTTP errors (404, 405, a body that does not parse)."""
    assert isinstance(exc, StarletteHTTPException)
    cause = exc.__cause__
    if exc.status_code == 404:
        return error_response(_not_found(request))
    if exc.status_code == 405:
        allowed = _allowed_methods(request)
        err = MethodNotAllowed(
            f"{escaped(request.method, SHOWN_CHARS)} is not allowed on "
            f"{shown(request.url.path)}; allowed: {', '.join(allowed)}"
        )
        return error_response(err, headers={"Allow": ", ".join(allowed)})
    if isinstance(cause, GenqError):  # raised while FastAPI read the body (the body limit)
        return error_response(cause)
    if exc.status_code == 400 and cause is not None:
        return error_response(BadRequest(_unparsable(cause), param="body"))
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = error_body(str(exc.detail), type_, None, None)
    return JSONResponse(body, exc.status_code, headers=exc.headers)


def _not_found(request: Request) -> NotFound:
    path = request.url.path
    parts = path.strip("/").split("/")
    if len(parts) >= 2 and parts[0] == "v1" and parts[1] in OPENAI_UNSERVED:
        return NotFound(
            f"genq does not serve OpenAI's /v1/{parts[1]} API; /docs lists the routes it serves",
            param=None,
            code="unsupported_endpoint",
        )
    return NotFound(f"no route {shown(path)}; /docs lists the routes genq serves")


def _allowed_methods(request: Request) -> list[str]:
    """Every method the API document lists for this path (Starlette's 405 names only those of
    the first route that matched; GET and DELETE /v1/jobs/{id} are two routes)."""
    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        if compile_path(template)[0].fullmatch(request.url.path):
            methods |= {m.upper() for m in operations}
    return sorted(methods)


def _unparsable(cause: BaseException) -> str:
    """Why json.loads refused the body, for the client (FastAPI says only "error parsing")."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8 (byte {cause.start} is not part of a character)"
    if isinstance(cause, RecursionError):
        return "the body's JSON is nested too deeply"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits"
    return "the body is not valid JSON"


def _redis_error(request: Request, exc: Exception) -> JSONResponse:
    if is_out_of_memory(exc):
        log.warning("redis out of memory", extra={"error": str(exc)})
        body = error_body(OUT_OF_MEMORY, "server_error", None, "redis_out_of_memory")
    else:
        # one line per request would be one per 503 during an outage: the outage is logged
        state = getattr(request.app.state, "genq", None)
        level = failure_level(getattr(state, "redis", None))
        log.log(level, "redis unavailable", extra={"error": str(exc)})
        body = error_body(
            "the queue is unavailable; retry shortly", "server_error", None, "unavailable"
        )
    return JSONResponse(body, 503, headers={"Retry-After": str(_RETRY_AFTER_S)})


def install(app: FastAPI) -> None:
    app.add_exception_handler(GenqError, _genq_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RedisError, _redis_error)
    app.add_exception_handler(ConnectionError, _redis_error)
