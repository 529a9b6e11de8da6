"""genq's Redis clients pack commands in one hiredis call (`RespPacker`): byte for byte what
redis-py's own packer makes, the same errors for what it refuses, and installed on every
connection `connect` makes; and read replies hiredis holds already without redis-py's timer
(`FastReader`), the same replies."""

from __future__ import annotations

from types import MethodType
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis._parsers.encoders import Encoder
from redis.connection import HiredisRespSerializer
from redis.exceptions import DataError, NoScriptError, ResponseError

from shared.redisconn import FastReader, RespPacker, connect
from shared.settings import Settings
from tests.conftest import REDIS_URL

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


async def test_replies_read_from_hiredis_are_redis_pys(settings: Settings) -> None:
    """Replies a pipeline brought in one read are taken from hiredis's reader without
    redis-py's timer (`FastReader`): the same values, errors in place (their own classes),
    blocking reads and scripts as before."""
    ours = connect(settings)
    plain = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    p = settings.key_prefix
    try:
        reads = ours.connection_pool.make_connection().read_response
        assert isinstance(reads, MethodType) and isinstance(reads.__self__, FastReader)
        await plain.hset(f"{p}h", mapping={"a": "1", "é": "✓"})
        await plain.xadd(f"{p}s", {"d": "x"}, id="0-1")
        replies = []
        for client in (ours, plain):
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(f"{p}h")
            pipe.hget(f"{p}h", "missing")
            pipe.incr(f"{p}h")  # WRONGTYPE, in place
            pipe.xrange(f"{p}s")
            pipe.evalsha("0" * 40, 0)  # NOSCRIPT, in place
            pipe.eval("return {1, 'two', {3}}", 0)
            pipe.ttl(f"{p}s")
            replies.append(await pipe.execute(raise_on_error=False))
        mine, theirs = replies
        assert [type(r) for r in mine] == [type(r) for r in theirs]
        assert isinstance(mine[4], NoScriptError)
        assert [str(r) if isinstance(r, Exception) else r for r in mine] == [
            str(r) if isinstance(r, Exception) else r for r in theirs
        ]
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await ours.incr(f"{p}h")
        assert await ours.xread({f"{p}s": "0-1"}, block=50) == []  # a read that waits
        assert await ours.get(f"{p}h-none") is None
    finally:
        await plain.delete(f"{p}h", f"{p}s")
        await ours.aclose()
        await plain.aclose()
