"""`create_app(settings)`: the gateway ASGI app. The lifespan owns Redis, the pub/sub router
and the batch loops (gateway/batch)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI

from gateway import http_errors
from gateway.batch import routes as batch_routes
from gateway.batch.runtime import BatchRuntime
from gateway.job_service import JobService
from gateway.openai import routes as openai_routes
from gateway.pubsub import PubSubRouter
from gateway.pubsub_wire import PubSubBackend, RawPubSub, RedisPyPubSub
from gateway.registry import ModelRegistry
from gateway.routes import health, jobs, models
from gateway.state import GatewayState
from shared import __version__, runtime
from shared.keys import Keys
from shared.redisconn import connect
from shared.settings import GatewaySettings
from shared.transitions import ScriptRunner


def create_app(
    settings: GatewaySettings,
    redis: aioredis.Redis | None = None,
    *,
    raw_pubsub: bool | None = None,
) -> FastAPI:
    """The gateway app. `redis` may be given (tests, `genq serve`); else from settings.

    `raw_pubsub`: stream events over genq's own hiredis pub/sub connection to
    `settings.redis_url` (default when the app makes its own client) rather than redis-py's.
    """
    use_raw = (redis is None) if raw_pubsub is None else raw_pubsub

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis or connect(settings)
        keys = Keys(settings.key_prefix)
        registry = ModelRegistry(client, keys, settings.card_cache_s)
        backend: PubSubBackend
        if use_raw and settings.redis_url:
            name = f"genq-gateway-pubsub-{os.getpid()}"
            backend = RawPubSub(settings.redis_url, settings.redis_socket_timeout_s, name)
        else:
            backend = RedisPyPubSub(client)
        router = PubSubRouter(backend)
        state = GatewayState(
            settings=settings,
            redis=client,
            keys=keys,
            router=router,
            registry=registry,
            jobs=JobService(settings, client, ScriptRunner(client), registry),
        )
        app.state.genq = state
        app.state.batch = batches = BatchRuntime(state)
        runtime.tune_gc()
        receiver = asyncio.create_task(router.run(), name="pubsub-router")
        batches.start()
        try:
            yield
        finally:
            state.draining = True
            await batches.stop()
            await router.close()
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver
            if redis is None:
                await client.aclose()

    app = FastAPI(
        title="genq",
        version=__version__,
        description="Queue-backed LLM generation: submit jobs, stream their tokens over SSE.",
        lifespan=lifespan,
    )
    http_errors.install(app)
    app.include_router(health.router)
    app.include_router(models.router)
    app.include_router(jobs.router)
    app.include_router(openai_routes.router)
    app.include_router(batch_routes.router)
    return app


def create_app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` (each `genq gateway` process builds its own settings)."""
    return create_app(GatewaySettings())
