"""Liveness (`/healthz`, and `/health` as vLLM and TGI clients probe it) and readiness."""

from __future__ import annotations

import os
import resource
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import RedisError

from gateway.deps import State, key_presented
from gateway.state import GatewayState

router = APIRouter(tags=["health"])


class Status(BaseModel):
    status: str
    models: dict[str, bool] | None = None
    """Whether a live worker serves each model."""
    pid: int | None = None
    streams: int | None = None
    rss_mb: float | None = None


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is alive (the path vLLM and TGI serve it on)."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "Draining, or Redis unreachable", "model": Status}},
    response_model=Status,
)
async def readyz(state: State, request: Request) -> JSONResponse:
    """200 while Redis answers and the gateway is not draining, with `models`: whether a live
    worker serves each model. With API keys set, only a request with a key also sees the
    process (pid, open streams, memory)."""
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    try:
        models = await _models_served(state)
    except (RedisError, OSError) as exc:
        body: dict[str, Any] = {"status": "redis unreachable"}
        if key_presented(state.settings, request):
            body["error"] = str(exc)
        return JSONResponse(body, 503)
    body = {"status": "ready", "models": models}
    if key_presented(state.settings, request):
        body |= {"pid": os.getpid(), "streams": state.router.channels, "rss_mb": _rss_mb()}
    return JSONResponse(body)


async def _models_served(state: GatewayState) -> dict[str, bool]:
    """Every model a worker ever announced: True while some live, undrained worker serves it."""
    known = await state.redis.smembers(state.keys.models())
    live = {b.model for b in await state.registry.live_workers() if not b.draining}
    return {m: m in live for m in sorted(known | live)}


def _rss_mb() -> float:
    """Resident memory now (Linux), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
