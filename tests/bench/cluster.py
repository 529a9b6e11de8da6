"""The CPU pipeline (`tests.bench.pipeline`: `genq gateway` + `genq worker --engine sim`,
loaded by `genq bench`) on one Redis and on a local Redis Cluster (3 primaries, 3 replicas,
`GENQ_QUEUE_SHARDS` 3), in one run: tokens/s of each and their ratio, and from INFO
commandstats of every primary, Redis commands per generated token and per job (script calls
and the commands they run both count, as Redis counts them) and each primary's share.

    python -m tests.bench.cluster --concurrency 64 --requests 512 --max-tokens 100

Both runs use the same features (jobs-in-flight fairness, no placement: what a cluster ran
when the first figures were taken, kept so the runs compare), so they differ only in where
Redis is.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import redis

from tests.bench.pipeline import run
from tests.cluster import LocalCluster, local_cluster
from tests.procs import redis_server

SAME_FEATURES = {"GENQ_FAIR_SCHEDULING": "jobs", "GENQ_PLACEMENT": "false"}
SHARDS = 3


def command_calls(ports: list[int]) -> dict[int, dict[str, int]]:
    """Per node: calls of each command so far (INFO commandstats)."""
    out = {}
    for port in ports:
        c = redis.Redis(port=port, decode_responses=True)
        stats = c.info("commandstats")
        c.close()
        out[port] = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    return out


def cpu_used(ports: list[int]) -> dict[int, float]:
    """Per node: CPU seconds its redis-server used so far (INFO cpu, user + system)."""
    out = {}
    for port in ports:
        c = redis.Redis(port=port, decode_responses=True)
        info = c.info("cpu")
        c.close()
        out[port] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return out


def command_figures(
    before: dict[int, dict[str, int]], after: dict[int, dict[str, int]], tokens: int, jobs: int
) -> dict[str, object]:
    per_node = {port: sum(after[port].values()) - sum(before[port].values()) for port in after}
    total = sum(per_node.values())
    by_command: dict[str, int] = {}
    for port in after:
        for cmd, n in after[port].items():
            d = n - before[port].get(cmd, 0)
            if d:
                by_command[cmd] = by_command.get(cmd, 0) + d
    mean = total / len(per_node)
    top = sorted(by_command.items(), key=lambda kv: -kv[1])[:12]
    busiest = max(per_node, key=lambda port: per_node[port])
    on_busiest = {cmd: n - before[busiest].get(cmd, 0) for cmd, n in after[busiest].items()}
    busiest_top = sorted(on_busiest.items(), key=lambda kv: -kv[1])[:8]
    deltas = {
        port: {cmd: n - before[port].get(cmd, 0) for cmd, n in after[port].items()}
        for port in after
    }
    commands = {cmd for ran in deltas.values() for cmd in ran}
    mean_of = {c: sum(ran.get(c, 0) for ran in deltas.values()) / len(deltas) for c in commands}
    above_mean = []  # per primary: the commands it runs most above the primaries' mean
    for ran in deltas.values():
        over = sorted(commands, key=lambda c: mean_of[c] - ran.get(c, 0))[:4]
        above_mean.append({c: round((ran.get(c, 0) - mean_of[c]) / max(1, jobs), 2) for c in over})
    return {
        "per_primary_above_mean_per_job": above_mean,
        "commands": total,
        "commands_per_token": round(total / max(1, tokens), 3),
        "commands_per_job": round(total / max(1, jobs), 1),
        "by_command_per_job": {k: round(v / max(1, jobs), 2) for k, v in top},
        "per_primary": list(per_node.values()),
        "per_primary_vs_mean": [round(n / mean - 1, 3) for n in per_node.values()],
        "busiest_primary_per_job": {k: round(v / max(1, jobs), 2) for k, v in busiest_top if v},
    }


def one_redis(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    args.env = dict(SAME_FEATURES)
    with redis_server() as server:
        assert server.proc is not None
        before, cpu_before = command_calls([server.port]), cpu_used([server.port])
        figures = run(args, server.url, tmp, server.proc.pid)
        after, cpu_after = command_calls([server.port]), cpu_used([server.port])
    figures.update(command_figures(before, after, figures["tokens"], args.requests))
    figures["redis_cpu_s"] = [round(cpu_after[server.port] - cpu_before[server.port], 3)]
    return figures


def on_cluster(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    with local_cluster() as cluster:
        args.env = {
            **SAME_FEATURES,
            "GENQ_REDIS_URL": "",
            "GENQ_REDIS_CLUSTER": cluster.seeds,
            "GENQ_QUEUE_SHARDS": str(SHARDS),
        }
        ports = primaries(cluster)
        before, cpu_before = command_calls(ports), cpu_used(ports)
        figures = run(args, "", tmp)
        after, cpu_after = command_calls(ports), cpu_used(ports)
    figures.update(command_figures(before, after, figures["tokens"], args.requests))
    figures["redis_cpu_s"] = [round(cpu_after[p] - cpu_before[p], 3) for p in ports]
    return figures


def primaries(cluster: LocalCluster) -> list[int]:
    return [n.port for n in cluster.primaries()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=0)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--gateway-procs", type=int, default=1)
    ap.add_argument("--api", default="native")
    args = ap.parse_args()
    args.json_schema = None
    with tempfile.TemporaryDirectory() as tmp:
        single = one_redis(args, Path(tmp))
        clustered = on_cluster(args, Path(tmp))
    keep = (
        "tokens_per_s",
        "tokens",
        "cpu_s",
        "commands_per_token",
        "commands_per_job",
        "by_command_per_job",
        "per_primary",
        "per_primary_vs_mean",
        "busiest_primary_per_job",
        "per_primary_above_mean_per_job",
        "redis_cpu_s",
    )
    # the sizing model (docs/operations.md): a primary's CPU is its commands at the one-Redis
    # run's cost per command; checked against what each primary used
    us_per_command = single["redis_cpu_s"][0] * 1e6 / max(1, single["commands"])  # type: ignore[index,call-overload]
    predicted = [round(n * us_per_command / 1e6, 3) for n in clustered["per_primary"]]  # type: ignore[attr-defined]
    result = {
        "model": {
            "us_per_command": round(us_per_command, 2),
            "primary_cpu_s_predicted": predicted,
            "primary_cpu_s_measured": clustered["redis_cpu_s"],
        },
        "one_redis": {k: single.get(k) for k in keep},
        "cluster": {k: clustered.get(k) for k in keep},
        "tokens_per_s_ratio": round(clustered["tokens_per_s"] / single["tokens_per_s"], 3),  # type: ignore[operator]
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
