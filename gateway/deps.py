"""Route dependencies: `State` (the process's GatewayState), API-key auth yielding the
caller's identity (`Caller`), and the per-key request rate limit.

The Authenticate middleware (gateway/middleware.py) refuses a bad key before the body is
read; the dependency declares the security schemes (the Authorize button in /docs), checks
again for apps mounted without the middleware, and says who the caller is."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from gateway import access_log
from gateway.identity import OPEN, Identity
from gateway.state import GatewayState
from shared.errors import Unauthorized
from shared.records import owner_of
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


async def require_key(state: State, bearer: Bearer, api_key: ApiKeyHeader) -> Identity:
    """API-key auth when GENQ_API_KEYS (or GENQ_API_KEYS_FILE, GENQ_ADMIN_KEYS) is set; open
    otherwise. The caller's identity: the owner their jobs record, and whether an admin."""
    identity = identify(state.settings, bearer.credentials if bearer is not None else api_key)
    if identity.keyed:
        access_log.touched_by(identity.owner)
    return identity


def identify(settings: GatewaySettings, token: str | None) -> Identity:
    """Who presents `token`; Unauthorized unless the API is open or it is an accepted key."""
    keys = settings.accepted_api_keys
    if not keys:
        return OPEN
    raw = _raw(token)
    key = None if raw is None else _matching(raw, keys)
    if raw is None or key is None:
        raise Unauthorized(
            "missing or invalid API key (Authorization: Bearer <key>, or X-API-Key: <key>)"
        )
    admin = _matching(raw, settings.admin_api_keys) is not None
    options = settings.key_options(key)
    weight = options.weight or settings.key_weights.get(raw.decode("latin-1"), 1.0)
    return Identity(owner_of(raw), admin=admin, keyed=True, options=options, weight=weight)


def check_key(settings: GatewaySettings, token: str | None) -> None:
    """Unauthorized unless the API is open (no key set) or `token` is an accepted key."""
    identify(settings, token)


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request presents: `Authorization: Bearer <key>`, else `X-API-Key: <key>`
    (as HTTPBearer and APIKeyHeader read them)."""
    scheme, credentials = get_authorization_scheme_param(authorization)
    if authorization and scheme.lower() == "bearer" and credentials:
        return credentials
    return x_api_key or None


def accepted(settings: GatewaySettings, token: str | None) -> bool:
    """True when `token` is an accepted key, or the API is open."""
    try:
        check_key(settings, token)
    except Unauthorized:
        return False
    return True


def _raw(token: str | None) -> bytes | None:
    """A header value is its raw bytes decoded as latin-1 (ASGI), so encoding back gives
    them; None for no token, or one not from an HTTP header (no key can match it)."""
    if token is None:
        return None
    try:
        return token.encode("latin-1")
    except UnicodeEncodeError:
        return None


def _matching(raw: bytes, keys: list[str]) -> str | None:
    """The key `raw` is, compared in constant time on bytes (compare_digest refuses
    non-ASCII str: a 500, not a 401)."""
    return next((key for key in keys if hmac.compare_digest(raw, key.encode())), None)


Caller = Annotated[Identity, Depends(require_key)]


async def rate_limited(state: State, caller: Caller) -> None:
    """The caller's request rate limit (GENQ_RATE_LIMIT_PER_KEY), shared by all gateways."""
    await state.admission.check_rate(caller)


Authorized = Depends(require_key)
RateLimited = Depends(rate_limited)
