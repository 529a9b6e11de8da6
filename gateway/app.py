"""`create_app(settings)`: the gateway ASGI app. The lifespan owns Redis, the pub/sub router
and the batch loops (gateway/batch)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from gateway import http_errors, queues
from gateway.access_log import AccessLog
from gateway.batch import routes as batch_routes
from gateway.batch.runtime import BatchRuntime
from gateway.dashboard import routes as dashboard_routes
from gateway.dashboard.hub import DashboardHub
from gateway.deadline_sweep import DeadlineSweep
from gateway.fleet import FleetExporter
from gateway.job_service import JobService
from gateway.metrics import GatewayMetrics, ResponseMetrics
from gateway.middleware import Authenticate, BodyLimit
from gateway.openai import routes as openai_routes
from gateway.presence import Presence
from gateway.pubsub import PubSubRouter
from gateway.pubsub_wire import (
    Endpoint,
    PubSubBackend,
    RawPubSub,
    RedisPyPubSub,
    SentinelMaster,
    Target,
)
from gateway.registry import ModelRegistry
from gateway.routes import docs, health, jobs, metrics, models
from gateway.state import GatewayState
from shared import __version__, runtime
from shared.keys import Keys
from shared.redisconn import connect, sentinels
from shared.settings import GatewaySettings
from shared.transitions import ScriptRunner

EXPOSED_HEADERS = ["X-Job-Id", "X-Job-Ids", "Retry-After", "Idempotent-Replayed"]
"""Response headers a browser's script may read (CORS hides all but a few by default)."""
CORS_MAX_AGE_S = 600
"""How long a browser may cache a preflight's answer."""


def create_app(
    settings: GatewaySettings,
    redis: aioredis.Redis | None = None,
    *,
    raw_pubsub: bool | None = None,
) -> FastAPI:
    """The gateway app. `redis` may be given (tests, `genq serve`); else from settings.

    `raw_pubsub`: stream events over genq's own hiredis pub/sub connection to
    `settings.redis_url` or the sentinels' master (default when the app makes its own
    client) rather than redis-py's. ValueError, before anything serves, for a URL option
    that connection cannot honour.
    """
    use_raw = (redis is None) if raw_pubsub is None else raw_pubsub
    endpoint = (
        Endpoint.from_url(settings.redis_url, settings.redis_socket_timeout_s)
        if use_raw and settings.redis_url
        else None
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis or connect(settings)
        keys = Keys(settings.key_prefix)
        registry = ModelRegistry(client, keys, settings.card_cache_s)
        backend: PubSubBackend
        target: Endpoint | Target | None = endpoint
        if use_raw and settings.redis_sentinels:
            target = _sentinel_master(settings)
        if target is not None:
            backend = RawPubSub(target, f"genq-gateway-pubsub-{os.getpid()}")
        else:
            backend = RedisPyPubSub(client)
        router = PubSubRouter(
            backend,
            buffer_bytes=settings.stream_buffer_bytes,
            catchup_per_s=settings.stream_catchup_per_s,
        )
        scripts = ScriptRunner(client)
        jobs = JobService(settings, client, scripts, registry)
        state = GatewayState(
            settings=settings,
            redis=client,
            keys=keys,
            router=router,
            registry=registry,
            jobs=jobs,
            presence=Presence(settings, client, keys, jobs),
        )
        app.state.genq = state
        app.state.batch = batches = BatchRuntime(state)
        app.state.dashboard = dashboard = DashboardHub(settings, client, keys)
        runtime.tune_gc()
        receiver = asyncio.create_task(router.run(), name="pubsub-router")
        sweep = DeadlineSweep(settings, client, scripts, keys)
        fleet = FleetExporter(settings, client, keys, state.presence.id, app.state.metrics)
        background = [
            asyncio.create_task(fleet.run(), name="fleet-metrics"),
            receiver,
            asyncio.create_task(sweep.run(), name="deadline-sweep"),
            asyncio.create_task(state.admission.repair_loop(), name="admission-repair"),
            asyncio.create_task(state.presence.run(), name="gateway-presence"),
        ]
        groups = await queues.start(client, keys, settings.queue_models)
        batches.start()
        try:
            yield
        finally:
            state.draining = True
            await dashboard.close()
            await batches.stop()
            await queues.stop(groups)
            await router.close()
            for task in background:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*background)
            await state.presence.close()
            await fleet.close()
            if isinstance(target, SentinelMaster):
                await target.aclose()
            if redis is None:
                await client.aclose()

    app = FastAPI(
        title="genq",
        version=__version__,
        description="Queue-backed LLM generation: submit jobs, stream their tokens over SSE.",
        lifespan=lifespan,
        docs_url=None,  # served from the package by routes.docs, not from a CDN
        redoc_url=None,
    )
    http_errors.install(app)
    app.state.metrics = GatewayMetrics(fleet_max_age_s=settings.metrics_fleet_lease_s)
    install_middleware(app, settings)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(models.router)
    app.include_router(jobs.router)
    app.include_router(openai_routes.router)
    docs.install(app)
    app.include_router(batch_routes.router)
    if settings.dashboard:
        dashboard_routes.install(app)
    return app


def _sentinel_master(settings: GatewaySettings) -> SentinelMaster:
    assert settings.redis_sentinel_master is not None  # the settings refuse sentinels without
    password = settings.redis_password
    return SentinelMaster.of(
        sentinels(settings),
        settings.redis_sentinel_master,
        settings.redis_socket_timeout_s,
        settings.redis_username,
        password.get_secret_value() if password else None,
    )


def install_middleware(app: FastAPI, settings: GatewaySettings) -> None:
    """Outermost first: the access log and the response counter (they see every answer, a
    401 or a preflight's too), CORS (a preflight needs no key), the API key, the body limit."""
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, uploads=settings.file_max_bytes)
    app.add_middleware(Authenticate, settings=settings)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],
            expose_headers=EXPOSED_HEADERS,
            max_age=CORS_MAX_AGE_S,
        )
    app.add_middleware(ResponseMetrics, metrics=app.state.metrics, root=app)
    if settings.access_log:
        app.add_middleware(AccessLog)


def create_app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` (each `genq gateway` process builds its own settings)."""
    return create_app(GatewaySettings())
