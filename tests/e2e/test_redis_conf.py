"""deploy/redis.conf as a real redis-server reads it: loopback only, protected mode, AOF on,
its data in `dir`; and the chaos tests' way of starting from it still works."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.procs import free_port, redis_conf_in, redis_server, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
DEPLOY_REDIS_CONF = Path(__file__).resolve().parents[2] / "deploy" / "redis.conf"
TCP_LISTEN = "0A"
"""State of a listening socket in /proc/net/tcp."""


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as the kernel writes them) of sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == TCP_LISTEN:
                found.add(address)
    return found


@pytest.fixture
def deployed(tmp_path: Path) -> Iterator[tuple[redis.Redis, int]]:
    """redis-server on deploy/redis.conf; only port and dir changed (the file's own bind)."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", str(redis_conf_in(DEPLOY_REDIS_CONF, tmp_path)), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: socket.create_connection(("127.0.0.1", port), 0.2).close() is None,
            timeout=10,
            what="redis-server on deploy/redis.conf",
        )
        with redis.Redis(port=port, decode_responses=True) as client:
            yield client, port
    finally:
        proc.kill()
        proc.wait()


def test_it_listens_on_loopback_only(deployed: tuple[redis.Redis, int]) -> None:
    client, port = deployed
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    assert client.config_get("protected-mode")["protected-mode"] == "yes"
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and nothing on IPv6


def test_it_keeps_an_append_only_file_in_its_dir(
    deployed: tuple[redis.Redis, int], tmp_path: Path
) -> None:
    client, _ = deployed
    config = client.config_get("*")
    assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
    assert config["maxmemory-policy"] == "noeviction"
    assert Path(config["dir"]) == tmp_path
    client.set("k", "v")
    assert any((tmp_path / config["appenddirname"]).glob("*.aof"))


def test_the_file_names_a_real_data_dir_not_the_working_one() -> None:
    dirs = [
        line.split(maxsplit=1)[1]
        for line in DEPLOY_REDIS_CONF.read_text().splitlines()
        if line.split()[:1] == ["dir"]
    ]
    assert len(dirs) == 1 and Path(dirs[0]).is_absolute()


def test_the_chaos_tests_start_from_it() -> None:
    with redis_server(DEPLOY_REDIS_CONF) as server:
        with redis.Redis.from_url(server.url, decode_responses=True) as client:
            assert client.ping()
            assert client.config_get("appendonly")["appendonly"] == "yes"
            assert Path(client.config_get("dir")["dir"]) == server.dir
