"""Webhook delivery: every end that has an event to send reaches its endpoints, at least once.

The step that ends a job (EMIT of a final event, SETTLE) or sets a batch's final status
(BATCH_UPDATE) also adds the job's or batch's id to the outbox stream (`Keys.webhook_outbox`):
never an end without its event, whatever dies right after. One gateway process at a time
holds the webhook lease (`Keys.webhook_lease`: renewed each third of GENQ_WEBHOOK_LEASE_S,
also while a page is in flight, and checked every round) and, each round:

1. takes a page of new outbox entries (and those of a holder that died before it acked them,
   XAUTOCLAIM) and makes each entry's deliveries — its event to every endpoint that wants it,
   a delivery's id a hash of both — and sends them at once, GENQ_WEBHOOK_CONCURRENCY at a
   time. Then one MULTI acks the page's entries and writes a delivery record
   (`Keys.webhook_delivery`, due in `Keys.webhook_due`, a sorted set by next attempt) for each
   delivery that was not answered 2xx: a delivered event leaves no record. Until that MULTI
   the entries stay pending in the outbox's group, so a holder that dies mid-page has the
   next one send the page again (at least once; the event id is the same, so the receiver
   drops the repeat);
2. sends a page of the recorded deliveries that are due. Before an attempt its next one is
   put a timeout ahead, so a holder that dies mid-delivery has it sent again by the next.

A 2xx ends a delivery; a 410 Gone disables the endpoint (`Keys.webhook_disabled`); anything
else (a refused address, a timeout, a 5xx, a redirect: none is followed) is retried after an
exponential backoff with jitter, until GENQ_WEBHOOK_RETRY_WINDOW_S has passed since the
event: then it goes to the dead letters (`Keys.webhook_dead`), which /metrics counts.

Where it may connect and how: gateway/webhook_http.py (the SSRF rules, the checked address
connected to, answers read up to GENQ_WEBHOOK_MAX_RESPONSE_BYTES). Secrets stay in the
settings: a delivery record names its endpoint by URL, and the secret is looked up when it is
signed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, ResponseError

from gateway.metrics import WebhookMetrics
from gateway.webhook_http import AnswerError, Guard, Refused, Target, WebhookClient
from shared.errors import BadRequest
from shared.keys import Keys
from shared.loops import honour_cancel
from shared.schemas import WebhookTarget
from shared.settings import GatewaySettings
from shared.transitions import Call, ScriptRunner, lease
from shared.webhooks import (
    batch_event_type,
    delivery_id,
    event_body,
    event_id,
    job_event_type,
    response_event_type,
    secret_key,
    sign,
)

__all__ = ["Guard", "Refused", "Target", "WebhookSender", "check_job_webhook", "notify_for"]

log = logging.getLogger(__name__)

GROUP = "webhooks"
_JOB_FIELDS = ("status", "metadata", "result", "finished_at", "webhook")
"""What an event needs of its job's record (read alone: the record holds the prompt too)."""
PAGE_PER_SLOT = 4
"""Outbox entries, or recorded deliveries, a round takes per GENQ_WEBHOOK_CONCURRENCY slot."""
LEASE_RENEWALS = 3
"""Renewals of the lease per GENQ_WEBHOOK_LEASE_S, between rounds (which otherwise only check
it) and while a page is in flight."""
DEAD_LETTERS_CAP = 10_000
JOB_SECRET = "job"
"""A delivery's secret: GENQ_WEBHOOK_SECRET (a job's own webhook), else its endpoint's."""
USER_AGENT = "genq-webhooks"


def check_job_webhook(settings: GatewaySettings, target: WebhookTarget) -> None:
    """400 for a job's webhook this deployment would never send (before the job exists)."""
    if settings.webhook_secret is None:
        raise BadRequest(
            "this deployment sends no job webhooks: GENQ_WEBHOOK_SECRET is not set",
            param="webhook",
        )
    try:
        Guard(settings).check_url(target.url)
    except Refused as exc:
        raise BadRequest(str(exc), param="webhook.url") from None


def notify_for(settings: GatewaySettings, kind: str, own: WebhookTarget | None) -> bool:
    """Whether a job of `kind` ("job" or "response") has an event to send when it ends."""
    return own is not None or any(
        e.startswith(f"{kind}.") for ep in settings.webhooks for e in ep.events
    )


def batch_notify(settings: GatewaySettings) -> bool:
    return any(e.startswith("batch.") for ep in settings.webhooks for e in ep.events)


# ---- the sender ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    id: str
    url: str
    secret: str
    event: str
    kind: str
    body: bytes
    created_at: float
    attempts: int


@dataclass(frozen=True)
class Outcome:
    """What an attempt came to: `delivered`, `retried` (`reason`: the error), or given up,
    `dead` or `disabled` (`reason`: why, for the dead letter; `gone`: a 410 answered now)."""

    kind: str
    reason: str = ""
    gone: bool = False


DELIVERED = Outcome("delivered")


class WebhookSender:
    """The leased loop of one gateway process (see the module's doc)."""

    def __init__(
        self,
        settings: GatewaySettings,
        redis: aioredis.Redis,
        keys: Keys,
        token: str,
        metrics: WebhookMetrics | None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = keys
        self.token = token
        self.metrics = metrics
        self.scripts = ScriptRunner(redis)
        self.guard = Guard(settings)
        self.consumer = f"{token}-{uuid.uuid4().hex[:6]}"
        self.holding = False
        self._renewed = 0.0
        """When the lease was last renewed (monotonic), by the request's start."""
        self.http = WebhookClient(
            self.guard, settings.webhook_max_response_bytes, settings.webhook_concurrency
        )
        self._keys: dict[str, bytes] = {
            ep.url: secret_key(ep.secret.get_secret_value()) for ep in settings.webhooks
        }
        if settings.webhook_secret is not None:
            self._keys[JOB_SECRET] = secret_key(settings.webhook_secret.get_secret_value())

    def _lease(self, action: str, ttl_ms: int = 0) -> Call[bool]:
        return lease(self.keys.webhook_lease(), self.token, action, ttl_ms)

    @property
    def wanted(self) -> bool:
        """Whether this deployment sends webhooks at all (job ones may come any time once
        a secret is set)."""
        s = self.settings
        return bool(s.webhooks) or s.webhook_secret is not None

    async def run(self) -> None:
        if not self.wanted:
            return
        while True:
            busy = False
            try:
                busy = await self.round()
            except (RedisError, OSError) as exc:
                log.warning("webhook round failed; retrying", extra={"error": str(exc)})
                self.holding = False
            honour_cancel()
            if not busy:  # more to do: the next round at once
                await asyncio.sleep(self.settings.webhook_poll_s)

    async def close(self) -> None:
        self.http.close()
        if self.holding:
            with contextlib.suppress(RedisError, OSError):
                await self.scripts.run(self._lease("free"))
            self.holding = False

    async def round(self) -> bool:
        """One round: take the lease, or renew it when a third of it has passed (else check
        it, in the read); holding it, send a page of the outbox and one of what is due.
        Whether it found a full page of either (more may be waiting)."""
        since = time.monotonic() - self._renewed
        renewing = not self.holding or since >= self.settings.webhook_lease_s / LEASE_RENEWALS
        if renewing:
            held = await self._hold()
            if held != self.holding:
                log.info("webhooks " + ("sent from here" if held else "no longer sent from here"))
                if held:
                    await self._ensure_group()
            self.holding = held
            if not held:
                return False
        read = await self._read(renewing)
        if read is None:
            log.info("webhooks no longer sent from here")
            self.holding = False
            return False
        entries, due = read
        taken = await self.send_outbox(entries) if entries else 0
        sent = await self.send_due(due) if due else 0
        return taken >= self._page or sent >= self._page

    async def _hold(self) -> bool:
        asked = time.monotonic()
        held = await self.scripts.run(
            self._lease("hold", int(self.settings.webhook_lease_s * 1000))
        )
        if held:
            self._renewed = asked
        return held

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.webhook_outbox(), GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @property
    def _page(self) -> int:
        return self.settings.webhook_concurrency * PAGE_PER_SLOT

    # ---- the outbox: first attempts ---------------------------------------------------------

    async def _read(
        self, renewed: bool
    ) -> tuple[list[tuple[str, dict[str, str]]], list[str]] | None:
        """A page of new outbox entries and one of the recorded deliveries due, in one round
        trip. With the lease `renewed` just now, also the entries a holder now gone read and
        never acked (idle a lease long); else the lease is checked in the same trip: None
        where another holds it (the entries just read then wait, pending, for the holder to
        take them over)."""
        outbox = self.keys.webhook_outbox()
        idle_ms = int(self.settings.webhook_lease_s * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            if renewed:
                pipe.xautoclaim(outbox, GROUP, self.consumer, idle_ms, "0-0", count=self._page)
            else:
                pipe.get(self.keys.webhook_lease())
            pipe.xreadgroup(GROUP, self.consumer, {outbox: ">"}, count=self._page)
            pipe.zrangebyscore(self.keys.webhook_due(), "-inf", time.time(), 0, self._page)
            first, reply, due = await pipe.execute(raise_on_error=False)
        for answer in (reply, due):
            if isinstance(answer, Exception):
                raise answer
        entries: list[tuple[str, dict[str, str]]] = []
        if not renewed:
            if first != self.token:
                return None
        elif not isinstance(first, ResponseError):
            entries += [(i, f) for i, f in first[1] if f]
        for _, got in reply or []:
            entries += [(i, f) for i, f in got if f]
        return entries, due

    async def send_outbox(self, entries: Sequence[tuple[str, dict[str, str]]]) -> int:
        """A page of outbox entries sent to their endpoints, then acked in one MULTI with a
        delivery record for each attempt that failed; how many entries."""
        outbox = self.keys.webhook_outbox()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(self.keys.webhook_disabled())
            for _, fields in entries:
                if "batch" not in fields:
                    pipe.hmget(self.keys.job(fields.get("job", "")), *_JOB_FIELDS)
            disabled, *records = await pipe.execute()
        jobs = iter(records)
        deliveries: list[Delivery] = []
        for _, fields in entries:
            deliveries += self._deliveries_of(fields, None if "batch" in fields else next(jobs))
        outcomes = await self._attempt_all(deliveries, disabled)
        ids = [entry_id for entry_id, _ in entries]
        async with self.redis.pipeline(transaction=True) as tx:
            for d, outcome in zip(deliveries, outcomes, strict=True):
                self._write(tx, d, outcome, recorded=False)
            tx.xack(outbox, GROUP, *ids)
            tx.xdel(outbox, *ids)
            await tx.execute()
        self._count(deliveries, outcomes)
        return len(entries)

    def _deliveries_of(
        self, fields: dict[str, str], job: list[str | None] | None
    ) -> list[Delivery]:
        """The deliveries an outbox entry makes: its event to every endpoint that wants it
        (`job`: the job's `_JOB_FIELDS`, for a job's entry)."""
        now = time.time()
        targets: list[tuple[str, str]] = []  # (url, secret ref)
        if job is None:
            about = fields.get("batch", "")
            kind = batch_event_type(fields.get("status", ""))
            if kind is None:
                return []
        else:
            job_id = fields.get("job", "")
            status, metadata, result, finished_at, webhook = job
            if status is None:
                return []  # gone (retention passed): nothing to tell of
            try:
                api = json.loads(metadata).get("api") if metadata else None
                finish = json.loads(result).get("finish_reason") if result else None
                own = WebhookTarget.model_validate_json(webhook) if webhook else None
            except ValueError as exc:
                log.warning("webhook for a damaged job record skipped", extra={"error": str(exc)})
                return []
            if api == "openai.response":
                about = "resp_" + job_id
                kind = response_event_type(status, finish)
            else:
                about = job_id
                kind = job_event_type(status)
            if kind is None:
                return []
            now = float(finished_at) if finished_at else now
            if own is not None and own.wants(kind) and self.settings.webhook_secret is not None:
                targets.append((own.url, JOB_SECRET))
        targets += [(ep.url, ep.url) for ep in self.settings.webhooks if kind in ep.events]
        event = event_id(about, kind)
        body = event_body(about, kind, now, event)
        return [
            Delivery(delivery_id(event, url), url, secret, event, kind, body, now, 0)
            for url, secret in targets
        ]

    # ---- recorded deliveries: retries -------------------------------------------------------

    async def send_due(self, ids: Sequence[str]) -> int:
        """Send a page of the recorded deliveries due (`ids`); how many."""
        s, due = self.settings, self.keys.webhook_due()
        now = time.time()
        # the next attempt of each, should this holder die mid-delivery
        later = now + s.webhook_timeout_s * PAGE_PER_SLOT + s.webhook_lease_s
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(due, {i: later for i in ids}, xx=True)
            pipe.smembers(self.keys.webhook_disabled())
            for did in ids:
                pipe.hgetall(self.keys.webhook_delivery(did))
            _, disabled, *records = await pipe.execute()
        deliveries = [_delivery(i, raw) for i, raw in zip(ids, records, strict=True) if raw]
        outcomes = await self._attempt_all(deliveries, disabled)
        async with self.redis.pipeline(transaction=True) as tx:
            for d, outcome in zip(deliveries, outcomes, strict=True):
                self._write(tx, d, outcome, recorded=True)
            gone = [i for i, raw in zip(ids, records, strict=True) if not raw]
            if gone:
                tx.zrem(due, *gone)
            await tx.execute()
        self._count(deliveries, outcomes)
        return len(ids)

    # ---- attempts ---------------------------------------------------------------------------

    async def _attempt_all(
        self, deliveries: Sequence[Delivery], disabled: set[str]
    ) -> list[Outcome]:
        """Each delivery's attempt, GENQ_WEBHOOK_CONCURRENCY at once, the lease renewed
        meanwhile (a slow receiver may hold a page for several timeouts)."""
        outcomes: list[Outcome] = [DELIVERED] * len(deliveries)
        todo = iter(enumerate(deliveries))

        async def slot() -> None:
            for i, d in todo:
                outcomes[i] = await self._attempt(d, disabled)

        if not deliveries:
            return outcomes
        keeper = asyncio.create_task(self._keep_lease())
        try:
            n = min(self.settings.webhook_concurrency, len(deliveries))
            await asyncio.gather(*(slot() for _ in range(n)))
        finally:
            keeper.cancel()
        return outcomes

    async def _keep_lease(self) -> None:
        while True:
            await asyncio.sleep(self.settings.webhook_lease_s / LEASE_RENEWALS)
            with contextlib.suppress(RedisError, OSError):
                self.holding = await self._hold()

    async def _attempt(self, d: Delivery, disabled: set[str]) -> Outcome:
        if d.url in disabled:
            return Outcome("disabled", "the endpoint answered 410 Gone before")
        key = self._keys.get(d.secret)
        if key is None:
            return Outcome("dead", "its endpoint is no longer configured")
        headers = [
            ("content-type", "application/json"),
            ("user-agent", USER_AGENT),
            *sign(key, d.event, d.body).items(),
        ]
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.settings.webhook_timeout_s
        status = 0
        try:
            status = await self.http.post(d.url, headers, d.body, deadline)
            error = None if 200 <= status < 300 else f"answered {status}"
        except Refused as exc:
            error = f"refused: {exc}"
            log.warning("webhook not sent", extra={"url": _shown(d.url), "reason": str(exc)})
        except (AnswerError, OSError, ValueError) as exc:  # TimeoutError is an OSError
            error = f"{type(exc).__name__}: {exc}"[:300]
        if self.metrics is not None:
            self.metrics.seconds.observe(time.perf_counter() - started)
        if error is None:
            return DELIVERED
        if status == 410:
            return Outcome("disabled", "410 Gone: the endpoint is disabled", gone=True)
        if time.time() - d.created_at > self.settings.webhook_retry_window_s:
            return Outcome("dead", f"out of retries after {d.attempts + 1}: {error}")
        return Outcome("retried", error)

    # ---- outcomes ---------------------------------------------------------------------------

    def _write(self, tx: Pipeline, d: Delivery, outcome: Outcome, recorded: bool) -> None:
        """Queue on `tx` what `outcome` leaves in Redis; `recorded`: the delivery has a record
        (a retry), else it was an outbox entry's first attempt."""
        key, due = self.keys.webhook_delivery(d.id), self.keys.webhook_due()
        if outcome.kind == "retried":
            s = self.settings
            backoff = min(s.webhook_backoff_max_s, s.webhook_backoff_s * 2 ** min(d.attempts, 30))
            at = time.time() + backoff * random.uniform(0.5, 1.0)
            if recorded:
                tx.hset(key, mapping={"attempts": d.attempts + 1, "last_error": outcome.reason})
                tx.zadd(due, {d.id: at}, xx=True)  # never a record another holder ended
            else:
                tx.hset(key, mapping={**_record(d), "attempts": 1, "last_error": outcome.reason})
                tx.zadd(due, {d.id: at})
            return
        if outcome.kind != "delivered":
            log.warning(
                "webhook given up",
                extra={
                    "url": _shown(d.url),
                    "event": d.event,
                    "type": d.kind,
                    "reason": outcome.reason,
                },
            )
            if outcome.gone:
                tx.sadd(self.keys.webhook_disabled(), d.url)
            tx.xadd(
                self.keys.webhook_dead(),
                {
                    "delivery": d.id,
                    "event": d.event,
                    "type": d.kind,
                    "url": d.url,
                    "attempts": d.attempts + 1,
                    "reason": outcome.reason[:500],
                    "at": time.time(),
                },
                maxlen=DEAD_LETTERS_CAP,
                approximate=True,
            )
        if recorded:
            tx.delete(key)
            tx.zrem(due, d.id)

    def _count(self, deliveries: Sequence[Delivery], outcomes: Sequence[Outcome]) -> None:
        if self.metrics is None:
            return
        now = time.time()
        counted = {kind: 0 for kind in WebhookMetrics.OUTCOMES}
        for d, outcome in zip(deliveries, outcomes, strict=True):
            counted[outcome.kind] += 1
            if outcome is DELIVERED:
                self.metrics.delay.observe(max(0.0, now - d.created_at))
        for kind, n in counted.items():
            if n:
                self.metrics.deliveries.labels(kind).inc(n)


def _record(d: Delivery) -> dict[str, Any]:
    return {
        "url": d.url,
        "secret": d.secret,
        "event": d.event,
        "type": d.kind,
        "body": d.body.decode(),
        "created_at": d.created_at,
        "attempts": d.attempts,
    }


def _delivery(did: str, raw: dict[str, str]) -> Delivery:
    return Delivery(
        did,
        raw["url"],
        raw["secret"],
        raw["event"],
        raw["type"],
        raw["body"].encode(),
        float(raw["created_at"]),
        int(raw.get("attempts", 0)),
    )


def _shown(url: str) -> str:
    """A URL as logs show it: scheme, host and path, never its query (it may hold a token)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
