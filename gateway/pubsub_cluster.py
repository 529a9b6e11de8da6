"""The gateway's pub/sub on a Redis Cluster: sharded channels, one raw connection per node.

A job's events are SPUBLISHed on its shard channel (shared/transitions.py), which only the
primary holding the channel's slot delivers. So the router's subscriptions are spread over
one `RawPubSub` (sharded mode: SSUBSCRIBE) per primary it needs, each channel on the node the
slot map names for its slot. When that may have changed (a node refused with MOVED, lost its
connection, or let go of a channel because its slot moved) the slot map is read again and
every channel whose node changed is subscribed where it lives now; then the router's catch-up
runs, as after any reconnect: each stream reads its event log, so what was published while a
channel moved costs latency, never data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from redis.crc import key_slot
from redis.exceptions import RedisError

from gateway.pubsub_wire import Endpoint, OnMessage, OnSubscribed, RawPubSub, ignore_channel

log = logging.getLogger(__name__)

REMAP_CHECK_S = 5.0
"""Besides trouble reported by a node, the slot map is read this often (a failover that a
node's connection has not noticed yet)."""
REMAP_PAUSE_S = 0.2
"""After trouble, this long before the slot map is read (a failover settles; and many
reports come together)."""


class ClusterPubSub:
    immediate = True

    def __init__(self, cluster: Any, template: Endpoint, name: str = "genq-gateway") -> None:
        """`cluster`: the gateway's `RedisCluster` client (its slot map); `template`: the
        credentials, TLS and timeouts of every node's connection."""
        self._cluster = cluster
        self._template = template
        self._name = name
        self._nodes: dict[str, RawPubSub] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._where: dict[str, str] = {}
        """Channel → the node (host:port) it is subscribed on."""
        self._trouble = asyncio.Event()
        self._closed = False
        self._on_message: OnMessage = lambda c, d: None
        self._on_reconnect: Callable[[], None] = lambda: None
        self._on_subscribed: OnSubscribed = ignore_channel

    @property
    def nodes(self) -> dict[str, set[str]]:
        """Node (host:port) → its channels: for tests and logs."""
        return {name: set(raw.channels) for name, raw in self._nodes.items()}

    async def run(
        self,
        on_message: OnMessage,
        on_reconnect: Callable[[], None],
        on_subscribed: OnSubscribed = ignore_channel,
    ) -> None:
        self._on_message, self._on_reconnect = on_message, on_reconnect
        self._on_subscribed = on_subscribed
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._trouble.wait(), REMAP_CHECK_S)
            if self._closed:
                return
            if self._trouble.is_set():
                await asyncio.sleep(REMAP_PAUSE_S)
            self._trouble.clear()
            try:
                await self._remap()
            except (RedisError, OSError) as exc:
                log.warning("pub/sub: the slot map could not be read", extra={"error": str(exc)})
                self._trouble.set()
                await asyncio.sleep(REMAP_PAUSE_S)

    async def _remap(self) -> None:
        """Read the slot map again; move each channel whose slot lives elsewhere now."""
        await self._cluster.nodes_manager.initialize()
        moved = 0
        for channel, old in list(self._where.items()):
            node = self._node_name(channel)
            if node != old:
                moved += 1
                if old in self._nodes:
                    await self._nodes[old].unsubscribe(channel)
                await self._subscribe_on(node, channel)
        for name in [n for n, raw in self._nodes.items() if not raw.channels]:
            await self._drop_node(name)
        if moved:
            log.info("pub/sub: channels followed their slots", extra={"channels": moved})
            self._on_reconnect()

    def _node_name(self, channel: str) -> str:
        node = self._cluster.nodes_manager.get_node_from_slot(key_slot(channel.encode()))
        return f"{node.host}:{node.port}"

    async def _subscribe_on(self, node: str, channel: str) -> None:
        raw = self._nodes.get(node)
        if raw is None:
            host, _, port = node.rpartition(":")
            endpoint = replace(self._template, host=host, port=int(port))
            raw = RawPubSub(endpoint, self._name, sharded=True, on_trouble=self._trouble.set)
            self._nodes[node] = raw
            self._tasks[node] = asyncio.create_task(
                raw.run(self._on_message, self._on_reconnect, self._on_subscribed),
                name=f"pubsub-{node}",
            )
        self._where[channel] = node
        await raw.subscribe(channel)

    async def _drop_node(self, name: str) -> None:
        raw = self._nodes.pop(name)
        task = self._tasks.pop(name)
        await raw.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def subscribe(self, *channels: str) -> None:
        if not self._cluster.nodes_manager.slots_cache:
            await self._cluster.initialize()
        for channel in channels:
            await self._subscribe_on(self._node_name(channel), channel)

    async def unsubscribe(self, *channels: str) -> None:
        for channel in channels:
            node = self._where.pop(channel, None)
            if node is not None and node in self._nodes:
                await self._nodes[node].unsubscribe(channel)

    async def close(self) -> None:
        self._closed = True
        self._trouble.set()
        for name in list(self._nodes):
            await self._drop_node(name)
