"""genq's Redis clients pack commands in one hiredis call (`RespPacker`): byte for byte what
redis-py's own packer makes, the same errors for what it refuses, and installed on every
connection `connect` makes."""

from __future__ import annotations

from typing import Any

import pytest
from redis._parsers.encoders import Encoder
from redis.connection import HiredisRespSerializer
from redis.exceptions import DataError

from shared.redisconn import RespPacker, connect
from shared.settings import Settings

COMMANDS: list[tuple[Any, ...]] = [
    ("SET", "k", "v"),
    ("EVALSHA", "f" * 40, 2, "genq:job:{a}", "genq:events:{a}", 1.5, 1796602548.352, -3),
    ("HSET", "h", "é", "ünïcode ✓", "big", 10**20, "small", 1e-7, "third", 1 / 3),
    ("XADD", "s", "*", "d", b"\x00\xffraw", "m", memoryview(b"view")),
    ("CLIENT UNBLOCK", 5),
    ("SET", "k", "x" * 100_000),
]


def _redis_py() -> HiredisRespSerializer:
    encoder = Encoder("utf-8", "replace", True)
    return HiredisRespSerializer(None, encoder.encode)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_bytes_are_redis_pys(command: tuple[Any, ...]) -> None:
    ours = RespPacker(_redis_py().pack)
    assert b"".join(ours.pack(*command)) == b"".join(_redis_py().pack(*command))


def test_what_hiredis_refuses_goes_to_redis_pys_packer() -> None:
    ours = RespPacker(_redis_py().pack)
    for bad in (True, None):
        with pytest.raises(DataError):
            ours.pack("SET", "k", bad)
    surrogate = ("SET", "k", "\ud800")  # not UTF-8: replaced, as redis-py does
    assert ours.pack(*surrogate) == _redis_py().pack(*surrogate)


async def test_connect_makes_connections_that_pack_with_it(settings: Settings) -> None:
    client = connect(settings)
    key = f"{settings.key_prefix}packer"
    try:
        conn = client.connection_pool.make_connection()
        assert isinstance(conn._command_packer, RespPacker)
        await client.set(key, "ünïcode ✓", ex=5)
        assert await client.get(key) == "ünïcode ✓"
    finally:
        await client.aclose()
