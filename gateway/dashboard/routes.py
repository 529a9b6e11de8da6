"""The dashboard's routes: the page and its assets (open: they hold no data), the login that
sets its cookie, and the data (admin only): one SSE stream, or one snapshot."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from gateway.auth_throttle import refusal
from gateway.dashboard.auth import COOKIE, COOKIE_PATH, admin_key, check_viewer, cookie_token
from gateway.dashboard.hub import DashboardHub
from gateway.deps import State, accepted, presented_key
from gateway.http_protocol import SHUTDOWN_EXTENSION
from gateway.streaming import EventStreamResponse
from shared.errors import Unauthorized

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
ASSETS_URL = "/dashboard/assets"
PAGE_HEADERS = {
    # Everything the page loads is its own: a script injected into the data cannot run.
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
MAX_KEY_CHARS = 512

router = APIRouter(prefix="/dashboard", include_in_schema=False)


def install(app: FastAPI) -> None:
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS_DIR), name="dashboard-assets")
    app.include_router(router)


def get_hub(request: Request) -> DashboardHub:
    hub: DashboardHub = request.app.state.dashboard
    return hub


Hub = Annotated[DashboardHub, Depends(get_hub)]


async def viewer(request: Request, state: State) -> None:
    try:
        check_viewer(state.settings, request)
    except Unauthorized as exc:
        token = presented_key(
            request.headers.get("authorization"), request.headers.get("x-api-key")
        )
        if token is None or accepted(state.settings, token):
            raise  # no key (a lapsed cookie), or a valid key that is not an admin's: not counted
        raise refusal(request, exc) from None  # a wrong key counts towards a 429


Viewer = Depends(viewer)


class Login(BaseModel):
    key: str = Field(min_length=1, max_length=MAX_KEY_CHARS)


@router.get("")
async def page() -> FileResponse:
    return FileResponse(ASSETS_DIR / "index.html", headers=PAGE_HEADERS)


@router.get("/session")
async def session(request: Request, state: State) -> dict[str, bool]:
    """Whether this browser may read the data now (`authorized`), and whether a login is a
    thing here (`login`: API keys are set). 200 either way: the page asks before it reads."""
    try:
        check_viewer(state.settings, request)
    except Unauthorized:
        authorized = False
    else:
        authorized = True
    return {"authorized": authorized, "login": bool(state.settings.accepted_api_keys)}


@router.post("/login", status_code=204)
async def login(body: Login, request: Request, state: State) -> Response:
    """The key in a JSON body (never a URL); the cookie that opens the data to this browser."""
    settings = state.settings
    if not admin_key(settings, body.key):
        exc = Unauthorized("not an admin key (GENQ_ADMIN_KEYS)", param="key")
        raise exc if accepted(settings, body.key) else refusal(request, exc)
    response = Response(status_code=204)
    response.set_cookie(
        COOKIE,
        cookie_token(body.key),
        max_age=settings.dashboard_session_s,
        path=COOKIE_PATH,
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


@router.post("/logout", status_code=204)
async def logout() -> Response:
    response = Response(status_code=204)
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
    return response


@router.get("/snapshot", dependencies=[Viewer])
async def snapshot(hub: Hub) -> Response:
    return Response(await hub.snapshot(), media_type="application/json")


@router.get("/events", dependencies=[Viewer], response_class=EventStreamResponse)
async def events(request: Request, hub: Hub, state: State) -> EventStreamResponse:
    shutdown: asyncio.Event | None = (
        request.scope.get("extensions", {}).get(SHUTDOWN_EXTENSION, {}).get("event")
    )
    return EventStreamResponse(
        _encoded(hub, shutdown), stall_timeout_s=state.settings.stream_stall_timeout_s
    )


async def _encoded(hub: DashboardHub, shutdown: asyncio.Event | None) -> AsyncIterator[bytes]:
    # Closed with this generator, not when collected: the viewer leaves the hub at once.
    async with contextlib.aclosing(hub.stream(shutdown)) as frames:
        async for frame in frames:
            yield frame.encode()
