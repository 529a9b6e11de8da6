"""A worker SIGKILLed in the middle of constrained jobs: each goes on on the other worker from
where its stream was, inside its constraint (the new worker replays the tokens generated
into its matcher), and its text is exactly an undisturbed run's, valid under the schema."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import jsonschema

from shared.constraints import grammar_of
from shared.schemas import Sampling
from tests.chaos.harness import Stream, follow, until
from tests.chaos.scenarios import Env, statuses, worker_pid
from worker.engine import EngineJob
from worker.sim import SimEngine, build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 12},
        "score": {"type": "integer"},
    },
    "required": ["title", "items", "score"],
    "additionalProperties": False,
}
JOBS = 12
MAX_TOKENS = 400


def reference(prompt: str, seed: int) -> str:
    """The text of an undisturbed run of the same job."""
    ids = build_tokenizer().encode(prompt, add_special_tokens=False).ids
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0)
    job = EngineJob(
        "ref", ids, MAX_TOKENS, Sampling(seed=seed), seed, grammar=grammar_of("json_schema", SCHEMA)
    )
    engine.add(job)
    parts: list[str] = []
    while engine.active():
        parts += [o.text for o in engine.step()]
    return "".join(parts)


async def test_sigkill_mid_constrained_job_finishes_inside_the_constraint(env: Env) -> None:
    env.cluster.gateway()
    workers = [env.worker("--step-ms", "60", "--max-batch", str(JOBS)) for _ in range(2)]
    await env.wait_workers(2)
    bodies = [
        {
            "model": "sim",
            "prompt": f"list {i}",
            "seed": i,
            "max_tokens": MAX_TOKENS,
            "json_schema": SCHEMA,
        }
        for i in range(JOBS)
    ]
    streams = [Stream(b) for b in bodies]
    tasks = [asyncio.create_task(follow(env.http, env.gateways, s)) for s in streams]

    async def all_streaming() -> bool:
        return all(s.tokens() >= 4 for s in streams)

    await until(all_streaming, 60, "every stream to be under way")
    owners = Counter([await env.owner(s.job_id or "") for s in streams])
    victim_id, moved = owners.most_common(1)[0]
    victim = next(w for w in workers if w.proc.pid == worker_pid(victim_id or "0-0-0"))
    victim.kill()
    killed_at = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 90)
    assert moved >= 1
    resumed = 0
    for s in streams:
        assert s.finished and s.events[-1].type == "done", s.events[-1:]
        jsonschema.validate(json.loads(s.text), SCHEMA)
        assert s.text == reference(s.body["prompt"], s.body["seed"]), s.job_id
        attempts = {e.data["attempt"] for e in s.events if e.type == "token"}
        resumed += len(attempts) > 1
    assert resumed >= 1, "no stream went on after the kill"
    assert await statuses(env, [s.job_id or "" for s in streams]) == {"succeeded": JOBS}
    assert time.monotonic() - killed_at < 90
