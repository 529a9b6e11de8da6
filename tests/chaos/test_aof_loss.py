"""Redis restarts without its last writes (the AOF's last second lost in a host crash) just
after a job finished: the worker that wrote them writes them again from memory, so the log
holds exactly what live readers saw, a reader resuming inside the lost range gets exactly
the rest, and the job does not run again (issue 12, item 3)."""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

from tests.chaos.harness import Stream, follow, until
from tests.chaos.scenarios import KEYS, Env, job_body

TOKENS = 60
SNAPSHOT_AFTER_TOKENS = 25
TIMEOUT_S = 30.0
AOF_DIR = "appendonlydir"


async def test_a_lost_aof_tail_is_written_again_exactly(env: Env, tmp_path: Path) -> None:
    gateway = env.cluster.gateway()
    worker = env.worker("--step-ms", "30")
    await env.wait_workers(1)
    stream = Stream(job_body(7, TOKENS))
    task = asyncio.create_task(follow(env.http, env.gateways, stream))

    async def under_way() -> bool:
        return stream.tokens() >= SNAPSHOT_AFTER_TOKENS

    await until(under_way, TIMEOUT_S, "the stream under way")
    # What a host crash leaves on disk: the AOF as of now (later writes will be lost).
    snapshot = tmp_path / "aof-snapshot"
    shutil.copytree(env.redis_server.dir / AOF_DIR, snapshot)
    await asyncio.wait_for(task, TIMEOUT_S)
    seen = [(e.seq, e.type, e.data) for e in stream.events]
    job = stream.job_id or ""

    # The worker is held still while Redis restarts and the test reads what was lost: it
    # reconnects and writes the end again within milliseconds, sooner than a loaded test
    # process reads the log.
    worker.signal(signal.SIGSTOP)
    try:
        env.redis_server.kill()
        shutil.rmtree(env.redis_server.dir / AOF_DIR)
        shutil.copytree(snapshot, env.redis_server.dir / AOF_DIR)
        env.redis_server.start()

        async def reconnected() -> bool:
            return bool(await env.redis.ping())

        await until(reconnected, TIMEOUT_S, "the test's client to reconnect")
        lost_at = len(await env.log(job))
    finally:
        worker.signal(signal.SIGCONT)
    assert lost_at < len(seen), "the restart should have lost the job's end"

    async def ended() -> bool:
        return await env.redis.hget(KEYS.job(job), "status") in ("succeeded", "failed")

    await until(ended, TIMEOUT_S, "the job's end written again")
    log = await env.log(job)
    assert [(e["seq"], e["type"], e) for e in log] == seen, "the log differs from what was seen"
    assert await env.redis.hget(KEYS.job(job), "attempt") == "1", "the job ran again"

    resume_after = (lost_at + len(seen)) // 2  # inside the range Redis lost
    r = await env.http.get(
        f"{gateway.url}/v1/jobs/{job}/events",
        headers={"Last-Event-ID": str(resume_after)},
        timeout=10,
    )
    tail = [(int(f["id"]), f["event"]) for f in _frames(r.text)]
    assert tail == [(seq, etype) for seq, etype, _ in seen if seq > resume_after]


def _frames(body: str) -> list[dict[str, str]]:
    out = []
    for frame in body.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in frame.splitlines() if line and not line.startswith(":")
        )
        if "id" in fields:
            out.append(fields)
    return out
