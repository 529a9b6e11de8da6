"""Route dependencies: `State` (the process's GatewayState) and API-key auth."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from gateway.state import GatewayState
from shared.errors import Unauthorized


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.genq
    return state


State = Annotated[GatewayState, Depends(get_state)]


async def require_key(state: State, authorization: Annotated[str | None, Header()] = None) -> None:
    """Bearer-token auth when GENQ_API_KEYS is set; open otherwise."""
    keys = state.settings.api_keys
    if not keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token, k) for k in keys):
        raise Unauthorized("missing or invalid API key (Authorization: Bearer <key>)")


Authorized = Depends(require_key)
