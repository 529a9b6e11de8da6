"""Where the raw pub/sub connection goes for a redis-py URL, and with what credentials and TLS."""

from __future__ import annotations

import ssl

import pytest

from gateway.pubsub_wire import NOT_APPLICABLE, Endpoint

TIMEOUT_S = 7.0


def test_a_tcp_url_gives_host_port_and_auth_as_redis_py_sends_it() -> None:
    e = Endpoint.from_url("redis://genq:pw@redis.internal:6380/3", TIMEOUT_S)
    assert (e.host, e.port, e.path, e.tls) == ("redis.internal", 6380, None, None)
    assert e.auth == ("genq", "pw") and e.username == "genq"
    assert e.connect_timeout_s == TIMEOUT_S
    assert Endpoint.from_url("redis://:pw@h", TIMEOUT_S).auth == ("pw",)
    assert Endpoint.from_url("redis://h", TIMEOUT_S).auth == ()


def test_a_unix_url_gives_the_socket_path() -> None:
    e = Endpoint.from_url("unix:///run/redis/redis.sock?db=2&password=pw", TIMEOUT_S)
    assert e.path == "/run/redis/redis.sock" and e.auth == ("pw",)
    assert e.where == "unix:/run/redis/redis.sock"


def test_rediss_verifies_the_certificate_and_host_name_by_default() -> None:
    e = Endpoint.from_url("rediss://h:6379", TIMEOUT_S)
    assert e.tls is not None
    assert e.tls.verify_mode == ssl.CERT_REQUIRED and e.tls.check_hostname


def test_rediss_takes_the_urls_verification_settings() -> None:
    e = Endpoint.from_url("rediss://h?ssl_cert_reqs=none", TIMEOUT_S)
    assert e.tls is not None
    assert e.tls.verify_mode == ssl.CERT_NONE and not e.tls.check_hostname
    e = Endpoint.from_url("rediss://h?ssl_check_hostname=false", TIMEOUT_S)
    assert e.tls is not None
    assert e.tls.verify_mode == ssl.CERT_REQUIRED and not e.tls.check_hostname


def test_the_urls_connect_timeout_and_client_name_win() -> None:
    e = Endpoint.from_url("redis://h?socket_connect_timeout=1.5&client_name=gw-a", TIMEOUT_S)
    assert e.connect_timeout_s == 1.5 and e.client_name == "gw-a"
    with pytest.raises(ValueError, match="client_name"):
        Endpoint.from_url("redis://h?client_name=gw%20a", TIMEOUT_S)


@pytest.mark.parametrize("option", sorted(NOT_APPLICABLE))
def test_pool_settings_of_redis_py_are_accepted(option: str) -> None:
    value = "true" if option in {"socket_keepalive", "retry_on_timeout", "legacy_responses"} else 2
    assert Endpoint.from_url(f"redis://h/0?{option}={value}", TIMEOUT_S).host == "h"
