"""A Sentinel-managed Redis of real processes: a master, a replica, three sentinels, each on a
free loopback port, for the failover test and benchmark.

Sentinel timings are short so a failover takes about two seconds, not the default half
minute: the master is "down" after DOWN_AFTER_MS without a reply, and two of the three
sentinels (the quorum) must agree before one of them promotes the replica.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.procs import RedisServer, free_port, wait_for

MASTER_NAME = "genq"
SENTINELS = 3
QUORUM = 2
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 10_000
DEPLOY_REDIS_CONF = Path(__file__).resolve().parents[2] / "deploy" / "redis.conf"


def sentinel_binary() -> list[str] | None:
    """Debian's `redis-sentinel`, else `redis-server --sentinel`; None without either."""
    if found := shutil.which("redis-sentinel"):
        return [found]
    if found := shutil.which("redis-server"):
        return [found, "--sentinel"]
    return None


@dataclass
class Sentinel:
    dir: Path
    master_port: int
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        conf = self.dir / f"sentinel-{self.port}.conf"  # sentinels rewrite their config
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        binary = sentinel_binary()
        assert binary is not None
        with open(self.dir / f"sentinel-{self.port}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [*binary[:1], str(conf), *binary[1:]], stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(
            lambda: socket.create_connection(("127.0.0.1", self.port), 0.2).close() is None,
            what="redis-sentinel",
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class SentinelGroup:
    master: RedisServer
    replica: RedisServer
    sentinels: list[Sentinel]

    @property
    def addresses(self) -> str:
        """GENQ_REDIS_SENTINELS."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    @property
    def env(self) -> dict[str, str]:
        return {"GENQ_REDIS_SENTINELS": self.addresses, "GENQ_REDIS_SENTINEL_MASTER": MASTER_NAME}

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers says."""
        for s in self.sentinels:
            with contextlib.suppress(redis.RedisError):
                with redis.Redis(port=s.port, socket_timeout=1) as r:
                    _, port = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
                    return int(port)
        return None

    def replicas_known(self) -> bool:
        """Every sentinel knows the replica and the other sentinels: a failover can happen."""
        for s in self.sentinels:
            with redis.Redis(port=s.port, socket_timeout=1, decode_responses=True) as r:
                state = r.sentinel_master(MASTER_NAME)
                if (
                    int(state["num-slaves"]) < 1
                    or int(state["num-other-sentinels"]) < SENTINELS - 1
                ):
                    return False
        return True

    def replica_in_sync(self) -> bool:
        with redis.Redis(port=self.replica.port, socket_timeout=1, decode_responses=True) as r:
            return r.info("replication")["master_link_status"] == "up"

    def close(self) -> None:
        for s in self.sentinels:
            s.kill()
        self.replica.kill()
        self.master.kill()


@contextlib.contextmanager
def sentinel_group() -> Iterator[SentinelGroup]:
    """Started and ready to fail over (the sentinels have found the replica and each other)."""
    with tempfile.TemporaryDirectory(prefix="genq-test-sentinel-") as tmp:
        root = Path(tmp)
        (root / "master").mkdir()
        (root / "replica").mkdir()
        master = RedisServer(root / "master", config=DEPLOY_REDIS_CONF)
        master.start()
        replica = RedisServer(
            root / "replica",
            config=DEPLOY_REDIS_CONF,
            args=("--replicaof", "127.0.0.1", str(master.port)),
        )
        group = SentinelGroup(master, replica, [])
        try:
            replica.start()
            wait_for(group.replica_in_sync, 15, what="the replica in sync")
            for _ in range(SENTINELS):
                s = Sentinel(root, master.port)
                group.sentinels.append(s)
                s.start()
            wait_for(group.replicas_known, 30, 0.1, what="sentinels that know each other")
            yield group
        finally:
            group.close()
