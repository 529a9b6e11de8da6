"""Where file contents live. `FileStore` is the interface (Redis now; an S3-compatible store
can take its place); a file is written once, as whole-line chunks, and becomes visible whole
at `commit` or not at all."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.redisconn import is_cluster

UPLOAD_TTL_S = 3600
"""Chunks of an upload whose gateway died before it committed expire after this long."""


class ChunkWriter(Protocol):
    async def append(self, chunk: bytes) -> None: ...

    async def commit(self, ttl_s: int) -> None:
        """The chunks appended become the file's content, all at once, for `ttl_s`."""
        ...

    async def abort(self) -> None: ...


class FileStore(Protocol):
    def writer(self, file_id: str) -> ChunkWriter: ...

    async def chunk(self, file_id: str, index: int) -> bytes | None:
        """Chunk `index` (0-based); None when the file (or that chunk) is gone."""
        ...

    def chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """Every chunk, in order."""
        ...

    async def delete(self, file_id: str) -> None: ...


class RedisChunkWriter:
    """Appends to a staging list of its own, renamed onto the file's content at commit."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, file_id: str) -> None:
        self._redis = redis
        self._staging = keys.file_upload(file_id, uuid.uuid4().hex)
        self._data = keys.file_data(file_id)
        self._chunks = 0

    async def append(self, chunk: bytes) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.rpush(self._staging, chunk)
        pipe.expire(self._staging, UPLOAD_TTL_S)
        await pipe.execute()
        self._chunks += 1

    async def commit(self, ttl_s: int) -> None:
        if self._chunks == 0:
            await self._redis.delete(self._data)
            return
        if is_cluster(self._redis):  # redis-py will not pipeline RENAME on a cluster; the
            # renamed list keeps the staging TTL until the EXPIRE, a moment later
            await self._redis.rename(self._staging, self._data)
            await self._redis.expire(self._data, ttl_s)
            return
        pipe = self._redis.pipeline(transaction=True)  # one slot: {file id}
        pipe.rename(self._staging, self._data)
        pipe.expire(self._data, ttl_s)
        await pipe.execute()

    async def abort(self) -> None:
        await self._redis.delete(self._staging)


class RedisFileStore:
    """File contents as a Redis list of chunks (`Keys.file_data`)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    def writer(self, file_id: str) -> ChunkWriter:
        return RedisChunkWriter(self._redis, self._keys, file_id)

    async def chunk(self, file_id: str, index: int) -> bytes | None:
        data = await self._redis.lindex(self._keys.file_data(file_id), index)
        return None if data is None else _bytes(data)

    async def chunks(self, file_id: str) -> AsyncIterator[bytes]:
        key = self._keys.file_data(file_id)
        index = 0
        while (data := await self._redis.lindex(key, index)) is not None:
            yield _bytes(data)
            index += 1

    async def delete(self, file_id: str) -> None:
        await self._redis.delete(self._keys.file_data(file_id))


def _bytes(data: bytes | str) -> bytes:
    """Chunks are UTF-8 (files are checked, or written, as such); a client that decodes
    replies hands them back as text."""
    return data.encode() if isinstance(data, str) else data
