"""The one place errors become HTTP: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from shared.errors import GenqError, Unauthorized

log = logging.getLogger(__name__)
_CHALLENGE = {"WWW-Authenticate": "Bearer"}
"""On every 401 (RFC 9110): the scheme a client should answer with."""


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
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


def _genq_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GenqError)
    headers = dict(_CHALLENGE) if isinstance(exc, Unauthorized) else {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return JSONResponse(body, exc.status, headers=headers or None)


def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    """422 naming each bad field and its limit, e.g. `max_tokens: Input should be ≤ 1000000`."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    parts, first_param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body", "query", "header", "path")]
        field = ".".join(loc) or "body"
        first_param = first_param or field
        parts.append(f"{field}: {e.get('msg', 'invalid')}")
    body = error_body("; ".join(parts), "invalid_request_error", first_param, "invalid_value")
    body["detail"] = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors
    ]
    return JSONResponse(body, 422)


def _redis_error(_: Request, exc: Exception) -> JSONResponse:
    if is_out_of_memory(exc):
        log.warning("redis out of memory", extra={"error": str(exc)})
        body = error_body(OUT_OF_MEMORY, "server_error", None, "redis_out_of_memory")
    else:
        log.warning("redis unavailable", extra={"error": str(exc)})
        body = error_body(
            "the queue is unavailable; retry shortly", "server_error", None, "unavailable"
        )
    return JSONResponse(body, 503, headers={"Retry-After": str(_RETRY_AFTER_S)})


def install(app: FastAPI) -> None:
    app.add_exception_handler(GenqError, _genq_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RedisError, _redis_error)
    app.add_exception_handler(ConnectionError, _redis_error)
