"""`create_app(settings)`: the gateway ASGI app. The lifespan owns Redis and the pub/sub router."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI

from gateway import errors
from gateway.cards import CardCache
from gateway.jobs import JobService
from gateway.openai import routes as openai_routes
from gateway.pubsub import PubSubRouter
from gateway.routes import health, jobs, models
from gateway.state import GatewayState
from shared import __version__
from shared.keys import Keys
from shared.redisconn import connect
from shared.scripts import Scripts
from shared.settings import Settings


def create_app(settings: Settings, redis: aioredis.Redis | None = None) -> FastAPI:
    """The gateway app. `redis` may be given (tests, `genq serve`); else from settings."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis or connect(settings)
        keys = Keys(settings.key_prefix)
        cards = CardCache(client, keys, settings.card_cache_s)
        router = PubSubRouter(client)
        state = GatewayState(
            settings=settings,
            redis=client,
            keys=keys,
            router=router,
            cards=cards,
            jobs=JobService(settings, client, Scripts.register(client), cards),
        )
        app.state.genq = state
        receiver = asyncio.create_task(router.run(), name="pubsub-router")
        try:
            yield
        finally:
            state.draining = True
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver
            await router.close()
            if redis is None:
                await client.aclose()

    app = FastAPI(
        title="genq",
        version=__version__,
        description="Queue-backed LLM generation: submit jobs, stream their tokens over SSE.",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(health.router)
    app.include_router(models.router)
    app.include_router(jobs.router)
    app.include_router(openai_routes.router)
    return app


def create_app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` (each `genq gateway` process builds its own settings)."""
    return create_app(Settings())
