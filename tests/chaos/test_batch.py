"""A 2,000-line batch while a worker and the gateway driving the batch are SIGKILLed and
redis-server is SIGKILLed and started again (AOF on): the batch completes, and every line is
in exactly one of its files, with the text an undisturbed run gives."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.chaos.harness import Reference, until
from tests.chaos.scenarios import KEYS, Env, chaos_env, worker_pid

LINES = 2000
MAX_TOKENS = 12
WORKER_ARGS = ("--step-ms", "15", "--max-batch", "24")
BATCH_ENV = {
    "GENQ_BATCH_LEASE_S": "1",
    "GENQ_BATCH_POLL_S": "0.1",
    "GENQ_BATCH_CLAIM_IDLE_S": "1",
    "GENQ_BATCH_SWEEP_S": "3",
    "GENQ_BATCH_MAX_IN_FLIGHT": "300",
    "GENQ_FILE_CHUNK_BYTES": "8192",
}
"""Short leases and small chunks: queueing goes on for most of the batch, and a dead
gateway's share moves within about a second."""
TIMEOUT_S = 90.0
LEASE_SEEN_S = 10.0


def _line(i: int) -> dict[str, Any]:
    body = {"model": "sim", "prompt": f"line {i} the model", "seed": i, "max_tokens": MAX_TOKENS}
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}


async def test_a_batch_survives_worker_gateway_and_redis_kills(tmp_path: Path) -> None:
    async with chaos_env(tmp_path, **BATCH_ENV) as env:
        try:
            await _scenario(env)
        except BaseException:
            print(env.tail_logs())
            raise


async def _scenario(env: Env) -> None:
    first, second = env.cluster.gateway(), env.cluster.gateway()
    workers = [env.worker(*WORKER_ARGS) for _ in range(2)]
    await env.wait_workers(2)
    content = "".join(json.dumps(_line(i)) + "\n" for i in range(LINES)).encode()
    f = await env.http.post(
        f"{first.url}/v1/files",
        data={"purpose": "batch"},
        files={"file": ("chaos.jsonl", content)},
    )
    assert f.status_code == 200, f.text
    body = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions"}
    created = await env.http.post(f"{first.url}/v1/batches", json=body)
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]

    async def batch() -> dict[str, Any]:
        url = env.gateways()[0]
        r = await env.http.get(f"{url}/v1/batches/{batch_id}")
        r.raise_for_status()
        return dict(r.json())

    async def progressed(n: int) -> bool:
        counts = (await batch())["request_counts"]
        return bool(counts["completed"] + counts["failed"] >= n)

    await until(lambda: progressed(LINES // 10), TIMEOUT_S, "a tenth of the batch done")
    workers[0].kill()
    driver = await _driving_gateway(env, batch_id)
    victim = next(g for g in (first, second) if g.proc.pid == driver)  # mid-queueing
    victim.kill()
    await until(lambda: progressed(LINES // 4), TIMEOUT_S, "a quarter done after the kills")
    env.redis_server.kill()
    survivor = env.gateways()[0]

    async def outage_seen() -> bool:
        return (await env.http.get(f"{survivor}/readyz")).status_code == 503

    await until(outage_seen, TIMEOUT_S, "the gateway to notice Redis is gone")
    env.redis_server.start()

    async def ended() -> bool:
        return (await batch())["status"] in ("completed", "failed", "expired", "cancelled")

    await until(ended, TIMEOUT_S, "the batch to end", poll=0.25)
    final = await batch()
    assert final["status"] == "completed", final
    out = await _lines(env.http, survivor, final["output_file_id"])
    err = await _lines(env.http, survivor, final["error_file_id"])
    seen = Counter(x["custom_id"] for x in out + err)
    assert sorted(seen) == sorted(f"c{i}" for i in range(LINES)), "a line missing"
    assert max(seen.values()) == 1, "a line twice"
    counts = final["request_counts"]
    assert (counts["completed"], counts["failed"]) == (len(out), len(err))
    assert not err, err[:3]  # nothing was lost: every job ended, retried where its worker died
    reference = Reference()
    for x in out:
        i = int(x["custom_id"][1:])
        text = x["response"]["body"]["choices"][0]["text"]
        assert text == reference.text(f"line {i} the model", i, MAX_TOKENS), x["custom_id"]
    assert all(p.proc.poll() is None for p in env.cluster.procs if p not in (victim, workers[0]))


async def _driving_gateway(env: Env, batch_id: str) -> int:
    """The pid of the gateway holding the batch's lease (tokens are `<host>-<pid>-<hex>`):
    with a small in-flight bound, it takes the lease to queue more lines as results come."""
    holder: list[str] = []

    async def held() -> bool:
        token = await env.redis.get(KEYS.batch_lease(batch_id))
        if token:
            holder.append(token)
        return bool(token)

    await until(held, LEASE_SEEN_S, "the batch's lease held", poll=0.005)
    return worker_pid(holder[-1])


async def _lines(http: httpx.AsyncClient, url: str, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    r = await http.get(f"{url}/v1/files/{file_id}/content")
    r.raise_for_status()
    return [json.loads(x) for x in r.text.splitlines()]
