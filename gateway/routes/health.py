"""Liveness and readiness."""

from __future__ import annotations

import os
import resource

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
    return JSONResponse(
        {
            "status": "ready",
            "pid": os.getpid(),
            "streams": state.router.channels,
            "rss_mb": _rss_mb(),
        }
    )


def _rss_mb() -> float:
    """Resident memory now (Linux), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
