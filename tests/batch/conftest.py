"""One real `python -m genq serve` (the sim engine, the Redis on 6379 under a key prefix of its
own) for the batch tests, and helpers to write input files and read results.

The sim engine runs 16 jobs at a time with 5 ms steps: a batch of a few hundred lines with
tens of tokens each stays in progress for seconds (long enough to cancel or expire it), one of
a few lines with a few tokens ends in a fraction of one. Small limits (lines, bytes) let the
limit tests send small files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types import Batch

from tests.conftest import REDIS_URL, test_prefix
from tests.openai.conftest import CHATML
from tests.procs import free_port, wait_for

MAX_LINES = 400
MAX_BYTES = 200_000
STEP_MS = 5
MAX_BATCH = 16
POISON = "poison-pill"
"""A prompt holding this fails every attempt (the sim engine's fault injection)."""
START_S = 30.0
END_S = 60.0
POLL_S = 0.05
ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass
class Serve:
    url: str
    prefix: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="package")
def genq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    port = free_port()
    prefix = test_prefix()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {
        **os.environ,
        "GENQ_REDIS_URL": REDIS_URL,
        "GENQ_KEY_PREFIX": prefix,
        "GENQ_CHAT_TEMPLATE": CHATML,
        "GENQ_BATCH_MAX_LINES": str(MAX_LINES),
        "GENQ_FILE_MAX_BYTES": str(MAX_BYTES),
        "GENQ_FILE_CHUNK_BYTES": "4096",
        "GENQ_BATCH_POLL_S": "0.1",
        "GENQ_SIM_POISON_MARKER": POISON,
        "GENQ_MAX_ATTEMPTS": "1",
        "GENQ_HEARTBEAT_S": "0.2",
        "GENQ_LEASE_S": "1",
        "GENQ_CLAIM_BLOCK_MS": "100",
    }
    args = ["serve", "--port", str(port), "--step-ms", str(STEP_MS), "--max-batch", str(MAX_BATCH)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    serve = Serve(url, prefix, proc, log)
    try:
        wait_for(
            lambda: any(m["id"] == "sim" for m in httpx.get(f"{url}/v1/models").json()["data"]),
            timeout=START_S,
            what=f"genq serve: {serve.output()[-800:] if log.exists() else ''}",
        )
        yield serve
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with redis.Redis.from_url(REDIS_URL) as r:
            keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                r.delete(*keys)


@pytest.fixture
def client(genq: Serve) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{genq.url}/v1", api_key="any", max_retries=0) as c:
        yield c


@pytest.fixture
def db() -> Iterator[redis.Redis]:
    with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
        yield r


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "sim",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            **body,
        },
    }


def completion_line(custom_id: str, prompt: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "sim", "prompt": prompt, "max_tokens": 4, **body},
    }


def jsonl(lines: Sequence[dict[str, Any] | str]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def run_batch(
    client: openai.OpenAI,
    lines: Sequence[dict[str, Any]],
    endpoint: str = "/v1/chat/completions",
    window: str = "24h",
) -> Batch:
    """Upload, create, and poll to the end."""
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window=window,  # type: ignore[arg-type]
    )
    return wait_ended(client, batch.id)


def wait_ended(client: openai.OpenAI, batch_id: str, within: float = END_S) -> Batch:
    deadline = time.monotonic() + within
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {within} s")
        time.sleep(POLL_S)


def wait_for_progress(client: openai.OpenAI, batch_id: str, done: int) -> Batch:
    deadline = time.monotonic() + END_S
    while True:
        batch = client.batches.retrieve(batch_id)
        counts = batch.request_counts
        if counts is not None and counts.completed + counts.failed >= done:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} did not reach {done} results")
        time.sleep(POLL_S)


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def by_custom_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for x in lines:
        assert x["custom_id"] not in out, f"custom_id {x['custom_id']} twice"
        out[x["custom_id"]] = x
    return out
