"""A private Redis Cluster for tests: 3 primaries and 3 replicas (redis-server's cluster mode on
free loopback ports, in a temporary dir), built with `redis-cli --cluster create`.

Started once per test module that asks for it (`cluster` in tests/conftest.py), and skipped
with the reason when this redis-server or redis-cli cannot make one.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.procs import RedisServer

NODES = 6
"""3 primaries and a replica of each."""
READY_S = 30.0


class ClusterUnavailable(RuntimeError):
    """This box cannot start a Redis Cluster (the reason says why)."""


CREATE_OPTIONS = ("--cluster-replicas", "1", "--cluster-yes")
BUS_OFFSET = 10000
"""A node's cluster bus listens on its port + 10000: both must be free (and under 65536)."""


def cluster_port() -> int:
    """A loopback port free with its bus port (an ephemeral port + 10000 may not exist)."""
    for _ in range(200):
        port = random.randrange(20000, 30000)
        try:
            for p in (port, port + BUS_OFFSET):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise ClusterUnavailable("no free pair of loopback ports for a cluster node")


@dataclass
class LocalCluster:
    dir: Path
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def seeds(self) -> str:
        """GENQ_REDIS_CLUSTER's form: host:port,host:port."""
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        redis_cli = shutil.which("redis-cli")
        if shutil.which("redis-server") is None or redis_cli is None:
            raise ClusterUnavailable("redis-server and redis-cli are needed for a Redis Cluster")
        for _ in range(NODES):
            port = cluster_port()
            node_dir = self.dir / str(port)
            node_dir.mkdir()
            args = (
                *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                *("--cluster-node-timeout", "2000", "--appendfsync", "everysec"),
                # a replica may take over however long its link was down (a test kills a
                # primary soon after the cluster is made)
                *("--cluster-replica-validity-factor", "0"),
            )
            server = RedisServer(node_dir, port=port, args=args)
            server.start()
            self.nodes.append(server)
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        made = subprocess.run(
            [redis_cli, "--cluster", "create", *addresses, *CREATE_OPTIONS],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if made.returncode != 0:
            raise ClusterUnavailable(f"redis-cli --cluster create failed: {made.stdout[-500:]}")
        self.wait_ready()

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, decode_responses=True)

    def wait_ready(self, timeout: float = READY_S) -> None:
        """Until every node says the cluster is ok and every slot has a primary."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._node_ok(n) for n in self.nodes if n.proc and n.proc.poll() is None):
                return
            time.sleep(0.1)
        raise ClusterUnavailable(f"the cluster was not ready within {timeout} s")

    @staticmethod
    def _node_ok(node: RedisServer) -> bool:
        """The cluster is ok as this node sees it, and a replica's link to its primary is up
        (its first sync done: until then it could not take over)."""
        with contextlib.suppress(redis.RedisError, OSError):
            c = redis.Redis(port=node.port, socket_timeout=1, decode_responses=True)
            try:
                info = c.cluster("info")  # parsed by redis-py into a dict
                replication = c.info("replication")
            finally:
                c.close()
            if replication.get("role") == "slave" and replication["master_link_status"] != "up":
                return False
            return bool(info["cluster_state"] == "ok" and int(info["cluster_slots_ok"]) == 16384)
        return False

    def primaries(self) -> list[RedisServer]:
        """The nodes serving as primaries now."""
        out = []
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                c = redis.Redis(port=n.port, socket_timeout=1, decode_responses=True)
                try:
                    if c.info("replication").get("role") == "master":
                        out.append(n)
                finally:
                    c.close()
        return out

    def node_of(self, slot: int) -> RedisServer:
        """The primary serving `slot` now."""
        c = self.client()
        try:
            node = c.nodes_manager.get_node_from_slot(slot)
        finally:
            c.close()
        return next(n for n in self.nodes if n.port == int(node.port))

    def move_slot(self, slot: int, to: RedisServer) -> int:
        """Migrate `slot` to the primary `to`, as `redis-cli --cluster reshard` does (IMPORTING,
        MIGRATING, MIGRATE its keys in batches, then SETSLOT NODE everywhere) while clients go
        on using it; how many keys moved."""
        source = self.node_of(slot)
        src = redis.Redis(port=source.port, decode_responses=True)
        dst = redis.Redis(port=to.port, decode_responses=True)
        try:
            src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
            moved = 0
            while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
                src.execute_command(
                    "MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "REPLACE", "KEYS", *keys
                )
                moved += len(keys)
            for node in self.primaries():
                c = redis.Redis(port=node.port, decode_responses=True)
                try:
                    c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
                finally:
                    c.close()
            return moved
        finally:
            src.close()
            dst.close()

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()


@contextlib.contextmanager
def local_cluster() -> Iterator[LocalCluster]:
    """A running cluster, torn down (processes killed, files removed) after."""
    with tempfile.TemporaryDirectory(prefix="genq-cluster-") as tmp:
        cluster = LocalCluster(Path(tmp))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
