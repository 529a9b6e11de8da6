"""Webhooks (gateway/webhooks.py) against a real receiver, a small HTTP server on loopback
(opened by GENQ_WEBHOOK_ALLOW_HOSTS): a job's own webhook and the deployment's endpoints,
signed so that the official openai SDK's `webhooks.unwrap()` verifies them; a receiver down,
then up, gets every event, repeats under the same id; 410 disables an endpoint; what runs
out of retries is a dead letter; redirects are not followed, a slow receiver is cut at the
timeout, a huge answer is not read; private addresses are refused unless allowed."""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from gateway.fleet import read_fleet
from gateway.webhook_http import Guard, Refused
from gateway.webhooks import WebhookSender
from shared.keys import Keys
from shared.settings import Settings
from tests.conftest import Stack, running_stack

REAL_REDIS = pytest.mark.parametrize("redis", ["redis"], indirect=True)

SECRET = "whsec_" + base64.b64encode(b"genq-webhook-test-key-32-bytes!!").decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"another-endpoint-key-32-bytes!!!").decode()


class Receiver:
    """A loopback HTTP server that records every POST; `answers` are the statuses of the next
    requests (then 200); `mode` makes it slow, redirect or answer without end."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], bytes]] = []
        self.delivered: list[bytes] = []
        """The bodies of the requests answered 2xx."""
        self.answers: list[int] = []
        self.mode = "ok"
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if receiver.mode == "slow" or (
                    receiver.mode == "hold_first" and len(receiver.seen) == 1
                ):
                    time.sleep(3 if receiver.mode == "slow" else 30)
                if receiver.mode == "redirect":
                    self.send_response(307)
                    self.send_header("location", "http://169.254.169.254/latest/meta-data/")
                    self.end_headers()
                    return
                status = receiver.answers.pop(0) if receiver.answers else 200
                if receiver.mode == "down":
                    status = 503
                if 200 <= status < 300:
                    receiver.delivered.append(body)
                self.send_response(status)
                if receiver.mode == "huge":
                    self.send_header("content-length", str(100 * 2**20))
                    self.end_headers()
                    chunk = b"x" * 65536
                    try:
                        for _ in range(1600):
                            self.wfile.write(chunk)
                    except OSError:
                        pass  # the sender stopped reading: as it should
                    return
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(body) for _, body in self.seen]


@contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


def hooked(settings: Settings, **more: Any) -> Settings:
    return Settings(
        **{
            **settings.model_dump(),
            "webhook_secret": SECRET,
            "webhook_allow_http": True,
            "webhook_allow_hosts": ["127.0.0.1"],
            "webhook_poll_s": 0.02,
            "webhook_backoff_s": 0.05,
            "webhook_backoff_max_s": 0.2,
            "webhook_timeout_s": 1.0,
            **more,
        }
    )


async def until(predicate: Any, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not predicate():
            await asyncio.sleep(0.02)


async def job(stack: Stack, **body: Any) -> str:
    r = await stack.client.post("/v1/jobs", json={"model": "sim", "prompt": "hi", **body})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def unwrap(seen: tuple[dict[str, str], bytes], secret: str) -> Any:
    headers, body = seen
    client = openai.OpenAI(api_key="unused", webhook_secret=secret)
    return client.webhooks.unwrap(body.decode(), headers)


@REAL_REDIS
async def test_a_jobs_webhook_is_signed_as_openai_signs_and_says_how_it_ended(
    settings: Settings, redis: aioredis.Redis
) -> None:
    with receiver() as rx:
        async with running_stack(hooked(settings), redis) as stack:
            done = await job(stack, max_tokens=3, webhook={"url": rx.url})
            gone = await job(stack, max_tokens=3, timeout_s=0.001, webhook={"url": rx.url})
            await until(lambda: len(rx.seen) == 2)
    kinds = {e["data"]["id"]: e["type"] for e in rx.events()}
    assert kinds == {done: "job.succeeded", gone: "job.expired"}
    for seen in rx.seen:
        event = unwrap(seen, SECRET)  # raises unless the signature is right
        assert event.id.startswith("evt_") and event.id == seen[0]["webhook-id"]
    with pytest.raises(openai.InvalidWebhookSignatureError):
        unwrap(rx.seen[0], OTHER_SECRET)


@REAL_REDIS
async def test_deployment_endpoints_get_the_events_they_asked_for(
    settings: Settings, redis: aioredis.Redis
) -> None:
    with receiver() as rx, receiver() as other:
        endpoints = [
            {
                "url": rx.url,
                "secret": OTHER_SECRET,
                "events": ["response.completed", "response.incomplete"],
            },
            {"url": other.url, "secret": OTHER_SECRET, "events": ["job.succeeded"]},
        ]
        async with running_stack(hooked(settings, webhooks=endpoints), redis) as stack:
            r = await stack.client.post(
                "/v1/responses", json={"model": "sim", "input": "hi", "max_output_tokens": 3}
            )
            rid = r.json()["id"]
            jid = await job(stack, max_tokens=2)
            await until(lambda: rx.seen and other.seen)
            await asyncio.sleep(0.2)  # nothing more comes
    [event] = [unwrap(s, OTHER_SECRET) for s in rx.seen]
    assert event.type in ("response.completed", "response.incomplete") and event.data.id == rid
    assert [unwrap(s, OTHER_SECRET).data.id for s in other.seen] == [jid]


@REAL_REDIS
async def test_a_receiver_down_gets_every_event_when_back_repeats_under_one_id(
    settings: Settings, redis: aioredis.Redis
) -> None:
    with receiver() as rx:
        rx.answers = [503] * 12  # down for the first dozen attempts
        async with running_stack(hooked(settings), redis) as stack:
            ids = [await job(stack, max_tokens=2, webhook={"url": rx.url}) for _ in range(4)]
            await until(lambda: sum(1 for h, _ in rx.seen) >= 16 and not rx.answers, 20)
            await until(lambda: len({e["data"]["id"] for e in rx.events()}) == 4, 20)
            await asyncio.sleep(0.3)
            due = await redis.zcard(stack.worker.st.keys.webhook_due())
    by_job: dict[str, set[str]] = {}
    for headers, body in rx.seen:
        by_job.setdefault(json.loads(body)["data"]["id"], set()).add(headers["webhook-id"])
    assert set(by_job) == set(ids)
    assert all(len(v) == 1 for v in by_job.values())  # every repeat under the event's one id
    assert due == 0


@REAL_REDIS
async def test_410_disables_and_what_runs_out_of_retries_is_a_dead_letter(
    settings: Settings, redis: aioredis.Redis
) -> None:
    with receiver() as gone, receiver() as broken:
        gone.answers = [410]
        broken.answers = [500] * 1000
        s = hooked(settings, webhook_retry_window_s=0.5)
        async with running_stack(s, redis) as stack:
            keys = stack.worker.st.keys
            await job(stack, max_tokens=2, webhook={"url": gone.url})
            await until(lambda: len(gone.seen) == 1)
            await job(stack, max_tokens=2, webhook={"url": gone.url})  # not sent: disabled
            await job(stack, max_tokens=2, webhook={"url": broken.url})

            async def dead() -> list:
                return await redis.xrange(keys.webhook_dead())

            async with asyncio.timeout(10):
                while len(await dead()) < 3:
                    await asyncio.sleep(0.05)
            letters = await dead()
            metrics = (await stack.client.get("/metrics")).text
    reasons = sorted(f["reason"] for _, f in letters)
    assert len(gone.seen) == 1 and len(broken.seen) > 2
    assert (
        sum("410" in r for r in reasons) == 2 and sum("out of retries" in r for r in reasons) == 1
    )
    assert all(SECRET not in json.dumps(f) for _, f in letters)  # never a secret
    assert 'genq_webhook_deliveries_total{outcome="dead"} 1.0' in metrics


@pytest.mark.parametrize("mode", ["redirect", "slow", "huge"])
@REAL_REDIS
async def test_redirects_slow_and_huge_receivers_are_bounded(
    settings: Settings, redis: aioredis.Redis, mode: str
) -> None:
    with receiver() as rx:
        rx.mode = mode
        async with running_stack(hooked(settings, webhook_retry_window_s=60), redis) as stack:
            t0 = time.monotonic()
            await job(stack, max_tokens=2, webhook={"url": rx.url})
            await until(lambda: len(rx.seen) >= 1)
            await asyncio.sleep(1.5)  # a timed-out attempt has ended by now
            due = await redis.zrange(stack.worker.st.keys.webhook_due(), 0, -1)
            elapsed = time.monotonic() - t0
    if mode == "huge":  # 2xx, the 100 MB answer not read: delivered, at once
        assert due == [] and len(rx.seen) == 1 and elapsed < 5
    else:  # a redirect is not followed, a slow answer times out: both retried later
        assert len(due) == 1


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x",
        "http://[::1]/x",
        "http://10.1.2.3/x",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:127.0.0.1]/x",
        "http://localhost/x",  # a name that resolves to loopback
        "http://0.0.0.0/x",
    ],
)
async def test_private_addresses_are_refused_unless_allowed(settings: Settings, url: str) -> None:
    s = Settings(**{**settings.model_dump(), "webhook_allow_http": True})
    with pytest.raises(Refused):
        await Guard(s).resolve(url)
    opened = Settings(
        **{
            **s.model_dump(),
            "webhook_allow_hosts": [
                "127.0.0.0/8",
                "::1/128",
                "10.0.0.0/8",
                "169.254.0.0/16",
                "localhost",
                "0.0.0.0",
            ],
        }
    )
    if "ffff" not in url:  # the mapped address is opened by its IPv4 network only
        await Guard(opened).resolve(url)


@REAL_REDIS
async def test_a_job_webhook_the_deployment_would_not_send_is_a_400(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings, redis) as stack:  # no secret
        r = await stack.client.post(
            "/v1/jobs", json={"model": "sim", "prompt": "x", "webhook": {"url": "https://a.b/"}}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "webhook"
    s = Settings(**{**settings.model_dump(), "webhook_secret": SECRET})
    async with running_stack(s, redis) as stack:
        for url, why in [("http://example.com/", "https"), ("https://10.0.0.1/", "private")]:
            r = await stack.client.post(
                "/v1/jobs", json={"model": "sim", "prompt": "x", "webhook": {"url": url}}
            )
            assert r.status_code == 400, r.text
            assert (
                r.json()["error"]["param"] == "webhook.url" and why in r.json()["error"]["message"]
            )


@REAL_REDIS
async def test_the_lease_is_kept_while_a_slow_receiver_holds_a_page(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """A page whose receiver is slow outlasts the lease: its holder renews it meanwhile, so no
    other gateway takes it over (and sends the page again) while it is still being sent."""
    with receiver() as rx:
        rx.mode = "slow"
        s = hooked(settings, webhook_lease_s=0.6, webhook_timeout_s=2.0)
        keys = Keys(s.key_prefix)
        record = {"status": "succeeded", "finished_at": time.time(), "webhook": '{"url":"%s"}'}
        await redis.hset(keys.job("j1"), mapping={**record, "webhook": record["webhook"] % rx.url})
        await redis.xadd(keys.webhook_outbox(), {"job": "j1"})
        holder = WebhookSender(s, redis, keys, "holder", None)
        other = WebhookSender(s, redis, keys, "other", None)
        try:
            page = asyncio.create_task(holder.round())
            await until(lambda: rx.seen)
            await asyncio.sleep(1.0)  # the lease as first taken has run out
            await other.round()
            assert not other.holding and await redis.get(keys.webhook_lease()) == "holder"
            await page
        finally:
            await holder.close()
            await other.close()
    assert len(rx.seen) == 1


@REAL_REDIS
async def test_the_end_and_its_outbox_entry_are_one_step(
    settings: Settings, redis: aioredis.Redis
) -> None:
    """No gateway sends (no secret: the loop is off), yet every ended job with a webhook is in
    the outbox, and no job without one."""
    s = Settings(**{**settings.model_dump(), "webhook_secret": SECRET})
    async with running_stack(s, redis) as stack:
        stack.worker  # noqa: B018
        keys = stack.worker.st.keys
        await redis.set(keys.webhook_lease(), "someone-else", px=60_000)  # nobody sends here
        hooked_ids = [
            await job(stack, max_tokens=2, webhook={"url": "https://example.com/"})
            for _ in range(3)
        ]
        plain = await job(stack, max_tokens=2)
        for j in [*hooked_ids, plain]:
            await stack.wait_status(j, "succeeded")
        entries = await redis.xrange(keys.webhook_outbox())
        fleet = await read_fleet(redis, keys, [])
    assert sorted(f["job"] for _, f in entries) == sorted(hooked_ids)
    assert fleet.webhook_backlog == 3  # not yet sent: the backlog /metrics shows
