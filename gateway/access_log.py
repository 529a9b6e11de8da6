"""One access line per HTTP request (GENQ_ACCESS_LOG; it replaces uvicorn's, which is off):
method, route template, status, duration in ms, client address, the jobs the request created
or touched and, with API keys on, the caller's owner hash — never the key, the query or a body.

A streaming response is logged when it ends, with the time to its end: the ASGI call returns
only then. What a request touched is gathered while it runs through a context variable that
the route code fills (`touched_job`, `touched_by`); outside a request those calls do nothing.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

MAX_JOB_IDS = 32
"""Job ids one line names at most (a request may start up to GENQ_OPENAI_MAX_JOBS); the
count of the rest is logged beside them."""
MAX_PATH_CHARS = 200
"""An unmatched path (a 404) is logged as sent, cut to this."""
UNANSWERED = 500
"""The status of a request that raised before answering (uvicorn answers it 500)."""


@dataclass(slots=True)
class Touched:
    job_ids: list[str] = field(default_factory=list)
    owner: str | None = None


_touched: ContextVar[Touched | None] = ContextVar("genq_access_touched", default=None)


def touched_job(job_id: str) -> None:
    """The request being served created or looked at this job."""
    t = _touched.get()
    if t is not None and job_id not in t.job_ids:
        t.job_ids.append(job_id)


def touched_by(owner: str) -> None:
    """The request being served is the owner's (the hash of its API key)."""
    t = _touched.get()
    if t is not None:
        t.owner = owner


class AccessLog:
    """Outermost of genq's middleware, so that a 401 or 413 answered before any route, and a
    CORS preflight, are logged too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = UNANSWERED
        sent = 0

        async def watching_send(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        touched = Touched()
        token = _touched.set(touched)
        try:
            await self.app(scope, receive, watching_send)
        finally:
            _touched.reset(token)
            _log(scope, status, (time.perf_counter() - start) * 1000, sent, touched)


def _log(scope: Scope, status: int, duration_ms: float, sent: int, touched: Touched) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    method, route = scope["method"], route_of(scope)
    fields: dict[str, object] = {
        "method": method,
        "route": route,
        "status": status,
        "duration_ms": round(duration_ms, 2),
        "bytes": sent,
    }
    client = scope.get("client")
    if client:
        fields["client"] = f"{client[0]}:{client[1]}"
    ids = touched.job_ids
    if len(ids) == 1:
        fields["job_id"] = ids[0]
    elif ids:
        fields["job_ids"] = ids[:MAX_JOB_IDS]
        fields["jobs"] = len(ids)
    if touched.owner is not None:
        fields["owner"] = touched.owner
    # made and handed over directly: `log.info` would also walk the stack for the caller's
    # file and line, which no genq formatter shows (a sixth of the line's cost)
    args = (method, route, status)
    log.handle(
        log.makeRecord(log.name, logging.INFO, __file__, 0, "%s %s %s", args, None, None, fields)
    )


def route_of(scope: Scope) -> str:
    """The template of the route that served the request (`/v1/jobs/{job_id}`), else the
    path as sent (nothing matched it), shortened."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str) and path:
        return path
    return str(scope.get("path", ""))[:MAX_PATH_CHARS]
