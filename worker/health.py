"""A worker process's probes, served by its HTTP server (worker/http.py).

/healthz: the process runs and its event loop answers. /readyz: the worker can take jobs —
its model is loaded and its card published, its engine is up (not restarting its process),
its last heartbeat reached Redis within its lease, and it is not draining; else 503 with the
reason. Orchestrators hold rollouts and disruption
budgets on readiness, so a replacement worker counts only once it can serve.
"""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import RedisError

from worker.http import HttpServer, Response
from worker.state import WorkerState

READY_REDIS_TIMEOUT_S = 2.0
"""/readyz asks Redis for the worker's heartbeat and card; it waits no longer than this."""


class Health:
    def __init__(self) -> None:
        self.state: WorkerState | None = None
        """The worker's state, once its engine is built (None while the model loads)."""

    def attach(self, state: WorkerState) -> None:
        self.state = state

    def install(self, server: HttpServer) -> None:
        server.route("/healthz", self.healthz)
        server.route("/readyz", self.readyz)

    async def healthz(self) -> Response:
        return Response.json(200, {"status": "ok"})

    async def readyz(self) -> Response:
        reason = await self.not_ready()
        st = self.state
        if reason is not None or st is None:
            return Response.json(503, {"status": "not_ready", "reason": reason})
        body = {"status": "ready", "worker_id": st.id, "model": st.model, "active": len(st.running)}
        return Response.json(200, body)

    async def not_ready(self) -> str | None:
        """Why the worker cannot take jobs now, or None when it can."""
        st = self.state
        if st is None:
            return "loading model"
        if st.stopping.is_set():
            return "draining"
        if st.engine.down is not None:
            return f"engine {st.engine.down}"
        if not st.lease.held():
            silent = time.monotonic() - st.lease.last_ok
            return f"lease lapsed: no heartbeat reached Redis for {silent:.1f} s"
        try:
            async with asyncio.timeout(READY_REDIS_TIMEOUT_S):
                pipe = st.redis.pipeline(transaction=False)
                pipe.exists(st.keys.worker(st.id))
                pipe.exists(st.keys.model_card(st.model))
                beat, card = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            return f"redis unreachable: {exc!r}"
        if not beat:
            return "no heartbeat in Redis yet"
        if not card:
            return "model card not published"
        return None
