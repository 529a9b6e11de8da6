"""Route dependencies: `State` (the process's GatewayState) and API-key auth."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from gateway.state import GatewayState
from shared.errors import Unauthorized


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
    """API-key auth when GENQ_API_KEYS (or GENQ_API_KEYS_FILE) is set; open otherwise."""
    keys = state.settings.accepted_api_keys
    if not keys:
        return
    token = bearer.credentials if bearer is not None else api_key
    if token is None or not _accepted(token, keys):
        raise Unauthorized(
            "missing or invalid API key (Authorization: Bearer <key>, or X-API-Key: <key>)"
        )


def _accepted(token: str, keys: list[str]) -> bool:
    """Constant-time match on bytes: compare_digest refuses non-ASCII str (a 500, not a 401).
    A header value is its raw bytes decoded as latin-1 (ASGI), so encoding back gives them."""
    try:
        raw = token.encode("latin-1")
    except UnicodeEncodeError:  # not from an HTTP header; no key can match it
        return False
    return any(hmac.compare_digest(raw, key.encode()) for key in keys)


Authorized = Depends(require_key)
