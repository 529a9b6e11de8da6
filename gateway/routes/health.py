"""Liveness (`/healthz`, and `/health` as vLLM and TGI clients probe it) and readiness."""

from __future__ import annotations

import os
import resource
import time
from collections import Counter
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import RedisError, ResponseError

from gateway.auth_throttle import AuthThrottle, client_of
from gateway.deps import State, accepted, presented_key
from gateway.http_errors import is_out_of_memory
from gateway.state import GatewayState
from shared.records import RecordError, StoppedWorker

router = APIRouter(tags=["health"])
_PROBE_TTL_MS = 10_000


class Capacity(BaseModel):
    workers: int
    """Live worker processes serving the model."""
    stopped: int
    """Its worker processes a launcher stopped for crash-looping (the others serve on)."""


class Status(BaseModel):
    status: str
    models: dict[str, bool] | None = None
    """Whether a live worker serves each model."""
    capacity: dict[str, Capacity] | None = None
    """Per model: its live worker processes, and those stopped for crash-looping."""
    stopped_workers: list[StoppedWorker] | None = None
    """The stopped ones: which, where, why (with a key, where API keys are set)."""
    pid: int | None = None
    streams: int | None = None
    rss_mb: float | None = None
    redis_memory: dict[str, Any] | None = None
    """How full Redis is, whether it takes writes, whether new jobs are admitted."""


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
    responses={
        503: {"description": "Draining, Redis unreachable or refusing writes", "model": Status}
    },
    response_model=Status,
)
async def readyz(state: State, request: Request) -> JSONResponse:
    """200 while Redis answers and takes writes and the gateway is not draining, with
    `models` (whether a live worker serves each model), `capacity` (each model's live worker
    processes, and those their launcher stopped for crash-looping: the model is served by
    fewer), `stopped_workers` (which those are, and why) and `redis_memory` (how full Redis
    is, whether new jobs are admitted: above GENQ_REDIS_MEMORY_LIMIT new jobs get a 503 but
    everything else is served). With API keys set, only a request with a key also sees the
    process (pid, open streams, memory), `stopped_workers` and `redis_memory`."""
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    keyed = _keyed(state, request)
    try:
        models, capacity = await _models_served(state)
        stopped = await _stopped(state)
        memory = await _memory(state)
    except (RedisError, OSError) as exc:
        body: dict[str, Any] = {"status": "redis unreachable"}
        if keyed:
            body["error"] = str(exc)
        return JSONResponse(body, 503)
    if memory["writes"] != "ok":
        oom = memory["writes"] == "refused: out of memory"
        status = "redis out of memory" if oom else "redis refuses writes"
        return JSONResponse({"status": status} | ({"redis_memory": memory} if keyed else {}), 503)
    for w in stopped:
        capacity.setdefault(w.model, {"workers": 0, "stopped": 0})["stopped"] += 1
    body = {"status": "ready", "models": models, "capacity": capacity}
    if keyed and stopped:
        body["stopped_workers"] = [w.model_dump() for w in stopped]
    if keyed:
        body |= {
            "pid": os.getpid(),
            "streams": state.router.channels,
            "rss_mb": _rss_mb(),
            "redis_memory": memory,
        }
    return JSONResponse(body)


def _keyed(state: GatewayState, request: Request) -> bool:
    """Whether the request brings an accepted key (or the API is open). A probe without a key
    is never counted; a wrong key tells a guesser something (the answer shows less), so it
    counts as a failed authentication and past the limit is refused (`AuthThrottle`)."""
    headers = request.headers
    token = presented_key(headers.get("authorization"), headers.get("x-api-key"))
    if accepted(state.settings, token):
        return True
    if token is not None:
        throttle: AuthThrottle = request.app.state.auth_throttle
        refused = throttle.failed(client_of(request.scope))
        if refused is not None:
            raise refused
    return False


async def _models_served(state: GatewayState) -> tuple[dict[str, bool], dict[str, Any]]:
    """Every model a worker ever announced: True while some live, undrained worker serves it;
    and per model, its live workers (`Capacity`, its stopped ones counted by the caller)."""
    known = await state.redis.smembers(state.keys.models())
    live = Counter(b.model for b in await state.registry.live_workers() if not b.draining)
    served = {m: m in live for m in sorted(known | set(live))}
    return served, {m: {"workers": live[m], "stopped": 0} for m in served}


async def _stopped(state: GatewayState) -> list[StoppedWorker]:
    """Worker processes their launchers stopped for crash-looping, as those still say."""
    raw = await state.redis.hgetall(state.keys.stopped_workers())
    now = time.time()
    out = []
    for value in raw.values():
        try:
            w = StoppedWorker.decode(value)
        except RecordError:
            continue
        if w.until > now:
            out.append(w)
    return sorted(out, key=lambda w: w.worker_id)


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
