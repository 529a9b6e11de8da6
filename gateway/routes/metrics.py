"""`GET /metrics`: Prometheus' scrape of this gateway (gateway/metrics.py) and, from the one
process holding the fleet lease, the fleet's gauges (gateway/fleet.py).

Open by default, as scrapers expect: it names models, routes and workers, never a job, a
prompt or a key. With GENQ_METRICS_REQUIRE_KEY it needs an admin key (Prometheus sends one
with `authorization: {credentials: …}`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.auth_throttle import refusal
from gateway.deps import State, identify, presented_key
from gateway.metrics import GatewayMetrics
from shared.errors import Unauthorized

router = APIRouter(include_in_schema=False)


@router.get("/metrics")
async def metrics(state: State, request: Request) -> Response:
    if state.settings.metrics_require_key:
        headers = request.headers
        token = presented_key(headers.get("authorization"), headers.get("x-api-key"))
        try:
            admin = identify(state.settings, token).admin
        except Unauthorized as exc:
            raise refusal(request, exc) from None  # a wrong key counts towards a 429
        if not admin:
            raise Unauthorized("/metrics needs an admin key (GENQ_METRICS_REQUIRE_KEY)")
    recorder: GatewayMetrics = request.app.state.metrics
    return Response(recorder.render(), media_type=recorder.content_type)
