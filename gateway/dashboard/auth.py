"""Who may read the dashboard: an admin key, as a header or as the login cookie's digest."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from gateway.deps import identify, presented_key
from shared.errors import Unauthorized
from shared.settings import GatewaySettings

COOKIE = "genq_dashboard"
COOKIE_PATH = "/dashboard"
_DOMAIN = b"genq-dashboard\0"
"""Separates the cookie's digest from any other hash of a key (the owner id among them)."""
NEEDS_ADMIN = "the dashboard needs an admin key (GENQ_ADMIN_KEYS): log in on /dashboard"


def cookie_token(key: str) -> str:
    """The cookie for `key`: a digest, so the cookie cannot be turned back into the key."""
    return hashlib.sha256(_DOMAIN + key.encode()).hexdigest()


def admin_key(settings: GatewaySettings, key: str) -> bool:
    """Whether `key` is an admin key (any key while the API is open)."""
    if not settings.accepted_api_keys:
        return True
    try:
        return identify(settings, key).admin
    except Unauthorized:
        return False


def _cookie_ok(settings: GatewaySettings, token: str) -> bool:
    tokens = [cookie_token(k) for k in settings.admin_api_keys]
    return any(hmac.compare_digest(token.encode(), t.encode()) for t in tokens)


def check_viewer(settings: GatewaySettings, request: Request) -> None:
    """Unauthorized unless the API is open or the request brings an admin key (header) or
    the login cookie of one."""
    if not settings.accepted_api_keys:
        return
    token = request.cookies.get(COOKIE)
    if token and _cookie_ok(settings, token):
        return
    key = presented_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
    if key is not None and admin_key(settings, key):
        return
    raise Unauthorized(NEEDS_ADMIN)
