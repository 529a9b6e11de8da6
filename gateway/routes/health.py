"""Liveness and readiness."""

from __future__ import annotations

import os
import resource
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError, ResponseError

from gateway.deps import State
from gateway.http_errors import is_out_of_memory

router = APIRouter(tags=["health"])
_PROBE_TTL_MS = 10_000


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: State) -> JSONResponse:
    """Redis answers and takes writes, and the gateway is not draining. `redis_memory` says
    how full Redis is and whether new jobs are admitted (a Redis above
    GENQ_REDIS_MEMORY_LIMIT refuses new jobs with 503 but still serves everything else)."""
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    try:
        await state.redis.ping()
        memory = await _memory(state)
    except (RedisError, OSError) as exc:
        return JSONResponse({"status": "redis unreachable", "error": str(exc)}, 503)
    if memory["writes"] != "ok":
        oom = memory["writes"] == "refused: out of memory"
        status = "redis out of memory" if oom else "redis refuses writes"
        return JSONResponse({"status": status, "redis_memory": memory}, 503)
    return JSONResponse(
        {
            "status": "ready",
            "pid": os.getpid(),
            "streams": state.router.channels,
            "rss_mb": _rss_mb(),
            "redis_memory": memory,
        }
    )


async def _memory(state: State) -> dict[str, Any]:
    """Redis's memory as admission sees it, and whether it takes a write now (a probe key
    with a TTL: at maxmemory with noeviction, Redis refuses it as it would a job)."""
    mem = await state.admission.memory()
    limit = state.settings.redis_memory_limit
    fraction = mem.fraction
    try:
        await state.redis.set(state.keys.write_probe(), "1", px=_PROBE_TTL_MS)
        writes = "ok"
    except ResponseError as exc:  # Redis answered, refusing (a connection error raises)
        writes = "refused: out of memory" if is_out_of_memory(exc) else f"refused: {exc}"
    return {
        "used_fraction": None if fraction is None else round(fraction, 3),
        "limit": limit or None,
        "policy": mem.policy or None,
        "admitting": writes == "ok" and not (limit and fraction is not None and fraction >= limit),
        "writes": writes,
    }


def _rss_mb() -> float:
    """Resident memory now (Linux), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
