"""A batch's end is told to the deployment's webhook endpoint (`batch.completed`), signed as
OpenAI signs, and at least once: `genq serve` holding the sending lease is SIGKILLed while
the receiver holds the first attempt open; another `genq serve` on the same Redis takes the
lease over and sends the event again, under the same id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.batch.conftest import CHATML, chat_line, jsonl
from tests.conftest import REDIS_URL, test_prefix
from tests.integration.test_webhooks import OTHER_SECRET, receiver
from tests.procs import free_port, wait_for

LEASE_S = 2.0
TIMEOUT_S = 3.0


@contextmanager
def serve(prefix: str, log: Path, hook: str) -> Iterator[str]:
    port = free_port()
    endpoints = [{"url": hook, "secret": OTHER_SECRET, "events": ["batch.completed"]}]
    env = {
        **os.environ,
        "GENQ_REDIS_URL": REDIS_URL,
        "GENQ_KEY_PREFIX": prefix,
        "GENQ_CHAT_TEMPLATE": CHATML,
        "GENQ_BATCH_POLL_S": "0.1",
        "GENQ_HEARTBEAT_S": "0.2",
        "GENQ_LEASE_S": "1",
        "GENQ_WEBHOOKS": json.dumps(endpoints),
        "GENQ_WEBHOOK_ALLOW_HTTP": "true",
        "GENQ_WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]',
        "GENQ_WEBHOOK_POLL_S": "0.05",
        "GENQ_WEBHOOK_LEASE_S": str(LEASE_S),
        "GENQ_WEBHOOK_TIMEOUT_S": str(TIMEOUT_S),
    }
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", "serve", "--port", str(port), "--step-ms", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: any(m["id"] == "sim" for m in httpx.get(f"{url}/v1/models").json()["data"]),
            timeout=60,
            what=f"genq serve: {log.read_text(errors='replace')[-800:]}",
        )
        proc.url = url  # type: ignore[attr-defined]
        yield proc  # type: ignore[misc]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_batch_end_is_told_again_after_the_sender_is_killed(tmp_path: Path) -> None:
    prefix = test_prefix()
    log = tmp_path / "serve.log"
    try:
        with receiver() as rx:
            rx.mode = "hold_first"  # the first attempt never gets its answer
            with serve(prefix, log, rx.url) as first:
                client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0)
                lines = [chat_line(f"l{i}", f"hello {i}", max_tokens=3) for i in range(2)]
                f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
                batch = client.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                wait_for(lambda: len(rx.seen) == 1, timeout=60, what="the first attempt")
                first.kill()  # mid-delivery: the receiver has it, no answer went back
                first.wait()
            killed_at = time.monotonic()
            with serve(prefix, log, rx.url):
                wait_for(lambda: len(rx.seen) >= 2, timeout=60, what="the event sent again")
            again_s = time.monotonic() - killed_at
        first_try, second_try = rx.seen[0], rx.seen[1]
        assert first_try[0]["webhook-id"] == second_try[0]["webhook-id"]
        event = openai.OpenAI(api_key="x", webhook_secret=OTHER_SECRET).webhooks.unwrap(
            second_try[1].decode(), second_try[0]
        )
        assert event.type == "batch.completed" and event.data.id == batch.id
        assert again_s < 60
    finally:
        with redis.Redis.from_url(REDIS_URL) as r:
            keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                r.delete(*keys)


pytestmark = pytest.mark.timeout(120)
