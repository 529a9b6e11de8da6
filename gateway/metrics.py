"""The gateway process's own metrics (responses, open SSE streams, client disconnects) and
`GET /metrics`, which renders them together with the fleet's gauges (gateway/fleet.py).

`genq gateway --workers N` runs N processes behind one port, and a scrape reaches any one
of them: prometheus-client's multiprocess mode (gateway/multiproc.py) makes each process
write its values into files of a directory they share, and every process renders all the
files, so each scrape sees the same totals. With one process the values live in this app's
own registry; the metrics and the code that records them are the same either way.

Labels are bounded: a route is its template (`/v1/jobs/{job_id}`), never the raw path, a
static file is its folder's (`/dashboard/assets/{path}`), and paths no route matches share
`unmatched`.

Each process's resident memory, CPU seconds and open files are the standard
`process_resident_memory_bytes`, `process_cpu_seconds_total` and `process_open_fds`. One
process exports prometheus_client's own collector; in multiprocess mode that collector would
show only the process a scrape reached, so each process writes its figures into gauges of
its own (a `pid` label; a dead process's leave with it), every fleet round and before it
renders.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from starlette.routing import Mount, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import multiproc
from gateway.placement import OUTCOMES

UNMATCHED = "unmatched"
"""The route label of a request no route matches (a 404): raw paths would be unbounded."""
CLIENT_CLOSED_REQUEST = 499
"""The status of a response nobody reads: its client disconnected (nginx's convention)."""
PROCESS_GAUGES = {
    "process_resident_memory_bytes": "Resident memory size in bytes.",
    "process_cpu_seconds_total": "Total user and system CPU time spent in seconds.",
    "process_open_fds": "Number of open file descriptors.",
}
"""The figures of prometheus_client's ProcessCollector each gateway process exports in
multiprocess mode, under the collector's names."""


class WebhookMetrics:
    OUTCOMES = ("delivered", "retried", "dead", "disabled")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.deliveries = Counter(
            "genq_webhook_deliveries",
            "Webhook delivery attempts by outcome: delivered (2xx), retried (refused, failed "
            "or timed out; tried again later), dead (out of retries), disabled (410 Gone).",
            ["outcome"],
            registry=registry,
        )
        for outcome in self.OUTCOMES:
            self.deliveries.labels(outcome)
        self.seconds = Histogram(
            "genq_webhook_delivery_seconds",
            "Time of one webhook delivery attempt, connect to answer.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.delay = Histogram(
            "genq_webhook_delay_seconds",
            "From the event (the end it tells of) to its delivery.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60, 600, 3600),
            registry=registry,
        )


class GatewayMetrics:
    """One per app. `render()` is what `/metrics` answers."""

    def __init__(self, fleet_max_age_s: float) -> None:
        self.multiprocess = multiproc.active()
        self.fleet_max_age_s = fleet_max_age_s
        """A fleet file older than this is not shown (its writer died: gateway/multiproc.py)."""
        # as vLLM: a `_created` series per series doubles the text (prometheus_client: untyped)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.responses = Counter(
            "genq_http_responses",
            "HTTP responses by route template, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.streams_open = Gauge(
            "genq_sse_streams_open",
            "SSE streams this gateway is sending now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.disconnects = Counter(
            "genq_client_disconnects",
            "Clients gone before their answer ended (they closed the connection, or stopped "
            "reading a stream and were let go), by route template.",
            ["route"],
            registry=r,
        )
        self._placements = Counter(
            "genq_placements",
            "Jobs by where placement put them: prefix (the worker caching their prompt), key "
            "(their conversation's worker), shared (the shared queue); stolen: moved from a "
            "worker's lane to the shared queue (its wait ran out, or the worker died).",
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self._placements.labels(outcome)
        self.webhooks = WebhookMetrics(r)
        self._process = ProcessCollector(registry=None if self.multiprocess else r)
        self._process_gauges = (
            {
                name: Gauge(name, doc, registry=r, multiprocess_mode="liveall")
                for name, doc in PROCESS_GAUGES.items()
            }
            if self.multiprocess
            else {}
        )
        self._responses: dict[tuple[str, str, int], Counter] = {}
        self.extra: list[Callable[[], bytes]] = []
        """More exposition text to answer with: `genq serve`'s in-process worker's."""
        self.fleet: bytes = b""
        """The fleet's gauges as exposition text, while this process exports them."""

    def placed(self, outcome: str, jobs: int = 1) -> None:
        self._placements.labels(outcome).inc(jobs)

    def responded(self, route: str, method: str, status: int) -> None:
        """One response. Each label set's child is looked up once: `labels()` validates and
        locks, 1.0 µs a request against 0.34 µs with the dict (bounded: routes are
        templates)."""
        key = (route, method, status)
        child = self._responses.get(key)
        if child is None:
            child = self._responses[key] = self.responses.labels(route, method, str(status))
        child.inc()

    def sample_process(self) -> None:
        """In multiprocess mode, this process's memory, CPU and open files into its gauges
        (the files its siblings read when they render)."""
        if not self._process_gauges:
            return
        for family in self._process.collect():
            for sample in family.samples:
                gauge = self._process_gauges.get(sample.name)
                if gauge is not None:
                    gauge.set(sample.value)

    def set_fleet(self, body: bytes) -> None:
        """The fleet's gauges this process exports from now on (b"": none)."""
        self.fleet = body
        if not self.multiprocess:
            return
        if body:
            multiproc.write_fleet(body)
        else:
            multiproc.clear_fleet()

    def render(self) -> bytes:
        """This process's metrics (every process's, in multiprocess mode) and the fleet's."""
        if self.multiprocess:
            self.sample_process()
            multiproc.forget_dead()
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            own = generate_latest(registry) + multiproc.read_fleet(self.fleet_max_age_s)
        else:
            own = generate_latest(self.registry) + self.fleet
        return own + b"".join(render() for render in self.extra)

    content_type = "text/plain; version=0.0.4; charset=utf-8"
    """The text format every Prometheus reads (prometheus_client's newest names 1.0.0)."""


class RouteNames:
    """The template of the route that served (or would serve) a request: the one routing
    chose, else (a middleware answered first: a 401, a 413) the API document's template that
    the path matches, else `unmatched`."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._templates: list[tuple[re.Pattern[str], str]] | None = None

    def __call__(self, scope: Scope) -> str:
        path = getattr(scope.get("route"), "path", None)
        if isinstance(path, str):
            return path or "/"
        return self._lookup(scope.get("path", ""))

    def _lookup(self, path: str) -> str:
        if self._templates is None:  # once, from FastAPI's own (cached) document
            paths = sorted(self.app.openapi().get("paths", {}), key=lambda t: t.count("{"))
            self._templates = [(compile_path(t)[0], t) for t in paths]
            # static files (the dashboard's, the docs'): the folder they are served from
            mounts = [r.path for r in self.app.routes if isinstance(r, Mount) and r.path]
            self._templates += [
                (compile_path(f"{m}/{{path:path}}")[0], f"{m}/{{path}}") for m in mounts
            ]
        return next((t for regex, t in self._templates if regex.fullmatch(path)), UNMATCHED)


class ResponseMetrics:
    """Counts every HTTP response by route template, method and status, the SSE streams
    open, and the answers whose client left before their end. Outermost, so that what the
    other middleware answer (401, 413) counts too."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, root: FastAPI) -> None:
        self.app = app
        self.metrics = metrics
        self.route_of = RouteNames(root)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int = CLIENT_CLOSED_REQUEST  # no response started: the client left first
        started = ended = stream = False
        failed = False

        async def watching_send(message: Message) -> None:
            nonlocal status, started, ended, stream
            if message["type"] == "http.response.start":
                status, started = int(message["status"]), True
                stream = _is_event_stream(message)
                if stream:
                    self.metrics.streams_open.inc()
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception:
            failed = True
            if not started:  # Starlette's outermost middleware answers it 500
                status = HTTPStatus.INTERNAL_SERVER_ERROR
            raise
        finally:
            if stream:
                self.metrics.streams_open.dec()
            route = self.route_of(scope)
            self.metrics.responded(route, scope["method"], status)
            if (not ended and not failed) or status == CLIENT_CLOSED_REQUEST:
                self.metrics.disconnects.labels(route).inc()


def _is_event_stream(start: Message) -> bool:
    return any(
        name == b"content-type" and value.startswith(b"text/event-stream")
        for name, value in start.get("headers", ())
    )
