"""Route dependencies: `State` (the process's GatewayState) and API-key auth."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from gateway.state import GatewayState
from shared.errors import Unauthorized
from shared.settings import GatewaySettings


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.genq
    return state


State = Annotated[GatewayState, Depends(get_state)]

# Security schemes, not plain header parameters: /docs shows one Authorize button for them.
# auto_error=False: a missing key is ours to judge (the API is open when no key is set).
_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>`")
_api_key_header = APIKeyHeader(
    name="X-API-Key", auto_error=False, description="`X-API-Key: <key>` (tabbyAPI's clients)"
)
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
ApiKeyHeader = Annotated[str | None, Depends(_api_key_header)]


async def require_key(state: State, bearer: Bearer, api_key: ApiKeyHeader) -> None:
    """API-key auth when GENQ_API_KEYS (or GENQ_API_KEYS_FILE) is set; open otherwise.

    The Authenticate middleware has already refused a bad key before the body was read; this
    dependency declares the security schemes (the Authorize button in /docs) and checks again
    for apps mounted without it."""
    check_key(state.settings, bearer.credentials if bearer is not None else api_key)


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request presents: `Authorization: Bearer <key>`, else `X-API-Key: <key>`
    (as HTTPBearer and APIKeyHeader read them)."""
    scheme, credentials = get_authorization_scheme_param(authorization)
    if authorization and scheme.lower() == "bearer" and credentials:
        return credentials
    return x_api_key or None


def check_key(settings: GatewaySettings, token: str | None) -> None:
    """Unauthorized unless the API is open (no key set) or `token` is an accepted key."""
    keys = settings.accepted_api_keys
    if keys and (token is None or not _accepted(token, keys)):
        raise Unauthorized(
            "missing or invalid API key (Authorization: Bearer <key>, or X-API-Key: <key>)"
        )


def key_presented(settings: GatewaySettings, request: Request) -> bool:
    """True when the request carries an accepted key, or the API is open."""
    token = presented_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
    try:
        check_key(settings, token)
    except Unauthorized:
        return False
    return True


def _accepted(token: str, keys: list[str]) -> bool:
    """Constant-time match on bytes: compare_digest refuses non-ASCII str (a 500, not a 401).
    A header value is its raw bytes decoded as latin-1 (ASGI), so encoding back gives them."""
    try:
        raw = token.encode("latin-1")
    except UnicodeEncodeError:  # not from an HTTP header; no key can match it
        return False
    return any(hmac.compare_digest(raw, key.encode()) for key in keys)


Authorized = Depends(require_key)
