"""`create_app(settings)`: the gateway ASGI app. The lifespan owns Redis, the pub/sub router
and the batch loops (gateway/batch)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import os
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from redis.credentials import UsernamePasswordCredentialProvider

from gateway import http_errors, queues
from gateway.access_log import AccessLog
from gateway.auth_throttle import AuthThrottle
from gateway.batch import routes as batch_routes
from gateway.batch.runtime import BatchRuntime
from gateway.compaction import Compactor
from gateway.dashboard import routes as dashboard_routes
from gateway.dashboard.hub import DashboardHub
from gateway.deadline_sweep import DeadlineSweep
from gateway.fleet import FleetExporter
from gateway.job_service import JobService
from gateway.keepalive import KeepaliveTicker
from gateway.metrics import GatewayMetrics, ResponseMetrics
from gateway.middleware import Authenticate, BodyLimit
from gateway.openai import routes as openai_routes
from gateway.placement import StealSweep
from gateway.presence import Presence
from gateway.pubsub import PubSubRouter
from gateway.pubsub_cluster import ClusterPubSub
from gateway.pubsub_wire import (
    Endpoint,
    PubSubBackend,
    RawPubSub,
    RedisPyPubSub,
    SentinelMaster,
    Target,
    tls_context,
)
from gateway.rate_headers import HEADERS, RateHeaders
from gateway.registry import ModelRegistry
from gateway.routes import docs, health, jobs, metrics, models
from gateway.state import GatewayState
from gateway.stopping import Stopping
from gateway.webhooks import WebhookSender
from shared import __version__, lifeline, runtime
from shared.redisconn import check_url, connect, sentinels
from shared.settings import GatewaySettings
from shared.transitions import ScriptRunner

EXPOSED_HEADERS = ["X-Job-Id", "X-Job-Ids", "Retry-After", "Idempotent-Replayed", *HEADERS]
"""Response headers a browser's script may read (CORS hides all but a few by default)."""
CORS_MAX_AGE_S = 600
"""How long a browser may cache a preflight's answer."""


def create_app(
    settings: GatewaySettings,
    redis: aioredis.Redis | None = None,
    *,
    raw_pubsub: bool | None = None,
    signals: bool = False,
) -> FastAPI:
    """The gateway app. `redis` may be given (tests, `genq serve`); else from settings.

    `raw_pubsub`: stream events over genq's own hiredis pub/sub connection to
    `settings.redis_url` or the sentinels' master (default when the app makes its own
    client) rather than redis-py's. ValueError, before anything serves, for a URL option
    that connection cannot honour, or that the URL's transport does not take.

    `signals`: the app's lifespan takes SIGINT and SIGTERM over from the server's handlers
    (gateway/stopping.py): a server genq's command line runs. `app.state.stopping` is the
    stop, for a caller that acts on it too (`genq serve`'s worker).
    """
    if redis is None and settings.redis_url:
        check_url(settings.redis_url)
    use_raw = (redis is None) if raw_pubsub is None else raw_pubsub
    endpoint = (
        Endpoint.from_url(settings.redis_url, settings.redis_socket_timeout_s)
        if use_raw and settings.redis_url
        else None
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await _start(app, stack, settings, redis, use_raw, endpoint)
            if signals:
                stopping.watch_signals()
                stack.callback(stopping.unwatch_signals)
            yield

    app = FastAPI(
        title="genq",
        version=__version__,
        description="Queue-backed LLM generation: submit jobs, stream their tokens over SSE.",
        lifespan=lifespan,
        docs_url=None,  # served from the package by routes.docs, not from a CDN
        redoc_url=None,
    )
    http_errors.install(app)
    app.state.stopping = stopping = Stopping(settings.shutdown_grace_s)
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


async def _start(
    app: FastAPI,
    stack: contextlib.AsyncExitStack,
    settings: GatewaySettings,
    redis: aioredis.Redis | None,
    use_raw: bool,
    endpoint: Endpoint | None,
) -> None:
    """Start what the gateway runs, each part registered on `stack` as it starts, so a part
    that fails unwinds those before it and shutdown stops them all in reverse: the batch
    loops, the consumer groups and the router before the tasks, which stop before presence
    and the fleet lease are cleared, and the Redis connections go last."""
    client = redis or connect(settings)
    if redis is None:
        stack.push_async_callback(client.aclose)
    target: Endpoint | Target | None = endpoint
    if use_raw and settings.redis_sentinels:
        target = master = _sentinel_master(settings)
        stack.push_async_callback(master.aclose)
    backend: PubSubBackend = (
        RawPubSub(target, f"genq-gateway-pubsub-{os.getpid()}")
        if target is not None
        else RedisPyPubSub(client)
    )
    if settings.redis_cluster:  # shard channels, whatever `raw_pubsub` says: redis-py's
        # SUBSCRIBE would never hear an SPUBLISH
        name = f"genq-gateway-pubsub-{os.getpid()}"
        backend = ClusterPubSub(client, _cluster_template(settings), name)
    keys = settings.keys()
    registry = ModelRegistry(client, keys, settings.card_cache_s, frozenset(settings.queue_models))
    scripts = ScriptRunner(client)
    jobs = JobService(settings, client, scripts, registry)
    presence = Presence(settings, client, keys, jobs)
    fleet = FleetExporter(settings, client, keys, presence.id, app.state.metrics)
    stack.push_async_callback(fleet.close)
    stack.push_async_callback(presence.close)
    router = PubSubRouter(
        backend,
        buffer_bytes=settings.stream_buffer_bytes,
        catchup_per_s=settings.stream_catchup_per_s,
    )
    state = GatewayState(
        settings=settings,
        redis=client,
        keys=keys,
        router=router,
        registry=registry,
        jobs=jobs,
        presence=presence,
        stopping=app.state.stopping,
    )
    state.stopping.on_begin(functools.partial(_drain, state))
    app.state.genq = state
    app.state.batch = batches = BatchRuntime(state)
    app.state.dashboard = dashboard = DashboardHub(settings, client, keys)
    runtime.tune_gc()
    sweep = DeadlineSweep(settings, client, scripts, keys)
    metrics: GatewayMetrics = app.state.metrics
    jobs.placement.counted = metrics.placed
    steal = StealSweep(settings, client, scripts, keys, metrics.placed)
    app.state.compactor = compactor = Compactor(settings, client, scripts, keys)
    app.state.keepalives = keepalives = KeepaliveTicker(settings.sse_keepalive_s)
    webhooks = WebhookSender(settings, client, keys, presence.id, metrics.webhooks)
    stack.push_async_callback(webhooks.close)
    _start_tasks(stack, router, state, fleet, sweep, compactor, keepalives, steal, webhooks)
    groups = await queues.start(client, keys, settings.queue_models)
    stack.push_async_callback(queues.stop, groups)
    batches.start()
    stack.push_async_callback(batches.stop)
    stack.push_async_callback(dashboard.close)  # its loop starts with its first viewer
    stack.callback(_end_streams, state)


def _start_tasks(
    stack: contextlib.AsyncExitStack,
    router: PubSubRouter,
    state: GatewayState,
    fleet: FleetExporter,
    sweep: DeadlineSweep,
    compactor: Compactor,
    keepalives: KeepaliveTicker,
    steal: StealSweep,
    webhooks: WebhookSender,
) -> None:
    """The background loops; at shutdown the router closes first (its receive loop ends),
    then every loop is cancelled and awaited."""
    background: list[asyncio.Task[None]] = []
    stack.push_async_callback(_cancel, background)
    loops = {
        "fleet-metrics": fleet.run,
        "pubsub-router": router.run,
        "deadline-sweep": sweep.run,
        "log-compaction": compactor.run,
        "sse-keepalives": keepalives.run,
        "admission-repair": state.admission.repair_loop,
        "gateway-presence": state.presence.run,
        "placement": state.jobs.placement.run,
        "placement-news": lambda: state.jobs.placement.listen(router),
        "steal-sweep": steal.run,
        "webhooks": webhooks.run,
    }
    for name, loop in loops.items():
        background.append(asyncio.create_task(loop(), name=name))
    stack.push_async_callback(router.close)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel every loop and wait for all of them to end (a plain gather would return at the
    first one cancelled, leaving the others running past the Redis connections' close)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _drain(state: GatewayState) -> None:
    """At the stop's begin, and first at shutdown: what still runs sees the gateway going."""
    state.draining = True


def _end_streams(state: GatewayState) -> None:
    """At shutdown (uvicorn waited for the connections): a stream still open ends now."""
    state.draining = True
    state.stopping.close()


def _cluster_template(settings: GatewaySettings) -> Endpoint:
    """What every node's pub/sub connection shares: credentials, TLS, the connect timeout."""
    password = settings.redis_password
    username = settings.redis_username
    auth = UsernamePasswordCredentialProvider(
        username, password.get_secret_value() if password else None
    ).get_credentials()
    return Endpoint(
        host="",
        port=0,
        connect_timeout_s=settings.redis_socket_timeout_s,
        tls=tls_context({}) if settings.redis_cluster_tls else None,
        auth=tuple(auth) if username or password else (),
        username=username,
    )


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
    401 or a preflight's too), CORS (a preflight needs no key), the API key, the body limit,
    and, while some key has a rate limit, its headers on the answers."""
    if settings.per_key_rates:
        app.add_middleware(RateHeaders)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, uploads=settings.file_max_bytes)
    app.state.auth_throttle = throttle = AuthThrottle(settings)  # the dashboard's login too
    app.add_middleware(Authenticate, settings=settings, throttle=throttle)
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
    """Factory for `uvicorn --factory` (each `genq gateway` process builds its own settings).
    A process spawned by uvicorn's supervisor (`--workers N`) dies with it: it gets SIGTERM,
    closes its listening socket at once and drains its streams, instead of serving on as an
    orphan that a restarted gateway could not bind beside."""
    supervisor = multiprocessing.parent_process()
    if supervisor is not None and supervisor.pid is not None:
        lifeline.die_with_parent(supervisor.pid)
    return create_app(GatewaySettings(), signals=True)
