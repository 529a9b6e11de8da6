"""Recovery after a worker SIGKILL, measured: chaos scenario 1 repeated `--reps` times.

    python -m tests.chaos.bench_recovery --reps 20 [--lease-s 1 --heartbeat-s 0.2]

Each repetition starts a private redis-server, a gateway and two sim workers, streams `--jobs`
seeded jobs, SIGKILLs the worker holding most of them once all are under way, and checks every
stream against an undisturbed reference run. Recovery of a job = from the kill to the first
token of its next attempt on the client. Prints one line per repetition, then the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
from pathlib import Path

from tests.chaos.harness import FAST_LEASES, quantile
from tests.chaos.scenarios import KillResult, chaos_env, worker_kill


async def run(args: argparse.Namespace) -> list[KillResult]:
    env = {"GENQ_LEASE_S": str(args.lease_s), "GENQ_HEARTBEAT_S": str(args.heartbeat_s)}
    results = []
    for rep in range(1, args.reps + 1):
        with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp:
            async with chaos_env(Path(tmp), **env) as e:
                r = await worker_kill(
                    e, jobs=args.jobs, max_tokens=args.max_tokens, step_ms=args.step_ms
                )
        results.append(r)
        rec = r.recoveries or [float("nan")]
        print(
            f"rep {rep:>3}: moved {r.moved:>3}/{r.jobs}  lost {r.lost}  dup {r.duplicated}  "
            f"wrong {r.wrong}  recovery p50 {quantile(rec, 0.5):.3f} s  max {max(rec):.3f} s",
            flush=True,
        )
    return results


def summary(results: list[KillResult], args: argparse.Namespace) -> dict[str, object]:
    recoveries = [x for r in results for x in r.recoveries]
    return {
        "reps": len(results),
        "jobs_per_rep": args.jobs,
        "lease_s": args.lease_s,
        "heartbeat_s": args.heartbeat_s,
        "step_ms": args.step_ms,
        "jobs_moved": sum(r.moved for r in results),
        "jobs_lost": sum(r.lost for r in results),
        "duplicates": sum(r.duplicated for r in results),
        "wrong_streams": sum(r.wrong for r in results),
        "recovery_p50_s": round(quantile(recoveries, 0.5), 3) if recoveries else None,
        "recovery_p90_s": round(quantile(recoveries, 0.9), 3) if recoveries else None,
        "recovery_max_s": round(max(recoveries), 3) if recoveries else None,
        "machine": f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}",
    }


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--step-ms", type=int, default=50)
    p.add_argument("--lease-s", type=float, default=float(FAST_LEASES["GENQ_LEASE_S"]))
    p.add_argument("--heartbeat-s", type=float, default=float(FAST_LEASES["GENQ_HEARTBEAT_S"]))
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args()
    s = summary(asyncio.run(run(args)), args)
    if args.json:
        print(json.dumps(s))
    else:
        for k, v in s.items():
            print(f"{k:>16}: {v}")
    failed = s["jobs_lost"] or s["duplicates"] or s["wrong_streams"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
