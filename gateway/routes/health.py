"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway.deps import State

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: State) -> JSONResponse:
    """Redis answers and the gateway is not draining."""
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    try:
        await state.redis.ping()
    except (RedisError, OSError) as exc:
        return JSONResponse({"status": "redis unreachable", "error": str(exc)}, 503)
    return JSONResponse({"status": "ready", "streams": state.router.channels})
