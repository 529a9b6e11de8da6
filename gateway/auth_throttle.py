"""Failed authentications, counted per client address: past GENQ_AUTH_FAIL_LIMIT in a window
of GENQ_AUTH_FAIL_WINDOW_S, a wrong or missing key is answered 429 (with Retry-After) instead
of 401, so guessing keys costs a window per few guesses. Only failures are counted: a request
with a valid key never touches the table, and passes from an address that is being refused.

The table is each gateway process's own, in memory, of at most GENQ_AUTH_FAIL_MAX_CLIENTS
addresses (the one that failed least recently goes first): no Redis round trip for a request
that is refused anyway, and nothing an attacker can grow. N processes allow N times the
limit; that bounds guessing as well, and keeps a Redis outage from opening or closing it.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import Scope

from shared.errors import GenqError, TooManyRequests, Unauthorized
from shared.settings import GatewaySettings

IPV6_PREFIX = 64
"""An IPv6 client is counted by its /64: a host is handed a whole /64 and can pick any
address in it, so counting single addresses would count nothing."""
UNKNOWN_CLIENT = "unknown"
"""Where the server names no peer (a unix socket): all such requests count as one client."""


@dataclass(slots=True)
class _Window:
    start: float
    failures: int = 0


class AuthThrottle:
    def __init__(
        self, settings: GatewaySettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = settings.auth_fail_limit
        self.window_s = settings.auth_fail_window_s
        self.max_clients = settings.auth_fail_max_clients
        self._clock = clock
        self._table: OrderedDict[str, _Window] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def failed(self, client: str) -> TooManyRequests | None:
        """Count a failed authentication from `client`; the 429 to answer it with once the
        client is past the limit in its window (else None: answer the 401)."""
        if self.limit == 0:
            return None
        now = self._clock()
        window = self._table.get(client)
        if window is None or now - window.start >= self.window_s:
            window = self._table[client] = _Window(now)
        window.failures += 1
        self._table.move_to_end(client)
        while len(self._table) > self.max_clients:
            self._table.popitem(last=False)
        if window.failures <= self.limit:
            return None
        wait = max(1, math.ceil(window.start + self.window_s - now))
        return TooManyRequests(
            f"too many failed authentications from this address: more than {self.limit} in "
            f"{self.window_s:g} s (GENQ_AUTH_FAIL_LIMIT); retry in {wait} s",
            code="too_many_auth_failures",
            retry_after_s=wait,
        )


def client_of(scope: Scope) -> str:
    """The client's address as the server reports it (behind a proxy that uvicorn trusts,
    FORWARDED_ALLOW_IPS, the one it forwarded for); an IPv6 one as its /64."""
    peer = scope.get("client")
    if not peer:
        return UNKNOWN_CLIENT
    host = str(peer[0])
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_PREFIX), strict=False))
    return host


def refusal(request: Request, exc: Unauthorized) -> GenqError:
    """The answer to a wrong key met outside the middleware (the dashboard's login, /metrics),
    counted in the same table: `exc`, or the 429 once the address is past the limit."""
    throttle: AuthThrottle = request.app.state.auth_throttle
    return throttle.failed(client_of(request.scope)) or exc
