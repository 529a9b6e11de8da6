"""The failed-authentication table: a window per address, forgotten when it ends; IPv6
clients counted by their /64; bounded; off at a limit of 0."""

from __future__ import annotations

from gateway.auth_throttle import AuthThrottle, client_of
from shared.settings import GatewaySettings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttle(clock: Clock, **settings: object) -> AuthThrottle:
    values: dict[str, object] = {"auth_fail_limit": 3, "auth_fail_window_s": 10.0, **settings}
    return AuthThrottle(GatewaySettings(**values), clock=clock)  # type: ignore[arg-type]


def test_past_the_limit_until_the_window_ends() -> None:
    clock = Clock()
    t = _throttle(clock)
    assert [t.failed("a") for _ in range(3)] == [None, None, None]
    clock.now += 4.2
    refused = t.failed("a")
    assert refused is not None and refused.status == 429 and refused.retry_after_s == 6
    clock.now += 5.7  # the window began at the first failure: it ends 10 s after it
    assert t.failed("a") is not None
    clock.now += 0.2
    assert t.failed("a") is None  # a new window


def test_the_least_recently_failed_address_goes_first() -> None:
    clock = Clock()
    t = _throttle(clock, auth_fail_max_clients=2)
    for _ in range(4):
        t.failed("a")
    t.failed("b")
    t.failed("a")  # a failed last: b goes
    t.failed("c")
    assert len(t) == 2
    assert t.failed("a") is not None  # still counted
    assert t.failed("b") is None  # forgotten: counts from one again


def test_a_limit_of_0_counts_nothing() -> None:
    t = _throttle(Clock(), auth_fail_limit=0)
    assert all(t.failed("a") is None for _ in range(100))
    assert len(t) == 0


def test_clients_are_addresses_and_ipv6_ones_their_64() -> None:
    assert client_of({"client": ("203.0.113.7", 5)}) == "203.0.113.7"
    one = client_of({"client": ("2001:db8:1:2::1", 5)})
    assert one == client_of({"client": ("2001:db8:1:2:ffff::9", 6)}) == "2001:db8:1:2::/64"
    assert client_of({"client": ("2001:db8:1:3::1", 5)}) != one
    assert client_of({"client": ("::ffff:192.0.2.1", 5)}) == "192.0.2.1"
    assert client_of({"client": None}) == client_of({}) == "unknown"
