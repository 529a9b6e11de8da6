"""Webhook delivery: every end that has an event to send reaches its endpoints, at least once.

The step that ends a job (EMIT of a final event, SETTLE) or sets a batch's final status
(BATCH_UPDATE) also adds the job's or batch's id to the outbox stream (`Keys.webhook_outbox`):
never an end without its event, whatever dies right after. One gateway process at a time
holds the webhook lease (`Keys.webhook_lease`) and, each round:

1. turns new outbox entries (and those of a holder that died before it had, XAUTOCLAIM) into
   deliveries — one per event and endpoint, its id a hash of both, written with the entry's
   ack in one MULTI, so an entry becomes its deliveries exactly once;
2. sends the deliveries that are due (`Keys.webhook_due`, a sorted set by next attempt), at
   most GENQ_WEBHOOK_CONCURRENCY at once. Before an attempt its next one is put a timeout
   ahead, so a holder that dies mid-delivery has it sent again by the next (at least once;
   the event id is the same, so the receiver drops the repeat). A 2xx ends the delivery; a
   410 Gone disables the endpoint (`Keys.webhook_disabled`); anything else (a refused
   address, a timeout, a 5xx, a redirect: none is followed) is retried after an exponential
   backoff with jitter, until GENQ_WEBHOOK_RETRY_WINDOW_S has passed since the event: then
   it goes to the dead letters (`Keys.webhook_dead`), which /metrics counts.

Where it may connect (`Target`): https only (http where GENQ_WEBHOOK_ALLOW_HTTP), the host
resolved here, every address checked (no loopback, private, link-local — the metadata
address among them —, multicast or reserved one, unless GENQ_WEBHOOK_ALLOW_HOSTS names the
host or a network holding the address), then the connection made to that checked address
itself (TLS still verifies the host name), so a name that resolves differently a moment
later (DNS rebinding) reaches nothing unchecked. An answer is read up to
GENQ_WEBHOOK_MAX_RESPONSE_BYTES. Secrets stay in the settings: a delivery record names its
endpoint by URL, and the secret is looked up when it is signed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import random
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from gateway.metrics import WebhookMetrics
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
    is_public,
    job_event_type,
    response_event_type,
    signed_headers,
)

log = logging.getLogger(__name__)

GROUP = "webhooks"
BATCH = 100
_JOB_FIELDS = ("status", "metadata", "result", "finished_at", "webhook")
"""What an event needs of its job's record (read alone: the record holds the prompt too)."""
PAGE_PER_SLOT = 4
"""Deliveries a round takes per GENQ_WEBHOOK_CONCURRENCY slot."""
DEAD_LETTERS_CAP = 10_000
JOB_SECRET = "job"
"""A delivery's secret: GENQ_WEBHOOK_SECRET (a job's own webhook), else its endpoint's."""


# ---- where a webhook may go ---------------------------------------------------------------


class Refused(Exception):
    """A URL or address a webhook may not reach; the message says why."""


@dataclass(frozen=True)
class Target:
    """A URL checked, with the address it will be sent to."""

    url: str
    host: str
    address: str
    port: int
    scheme: str

    def request_url(self) -> str:
        """The URL with the checked address in place of the host name."""
        parts = urlsplit(self.url)
        ip = ipaddress.ip_address(self.address)
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        return urlunsplit((parts.scheme, f"{host}:{self.port}", parts.path or "/", parts.query, ""))


class Guard:
    """The SSRF rules of GENQ_WEBHOOK_ALLOW_HTTP and GENQ_WEBHOOK_ALLOW_HOSTS."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.allow_http = settings.webhook_allow_http
        self.hosts: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in settings.webhook_allow_hosts:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.hosts.add(entry.lower().rstrip("."))

    def check_url(self, url: str) -> tuple[str, str, int]:
        """(scheme, host, port) of a URL a webhook may name; Refused otherwise. An address
        written in the URL is checked here too; a host name, when it is resolved."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("https", "http") or (scheme == "http" and not self.allow_http):
            raise Refused("webhook URLs are https (GENQ_WEBHOOK_ALLOW_HTTP allows http)")
        if parts.username or parts.password:
            raise Refused("a webhook URL carries no user or password")
        host = (parts.hostname or "").lower().rstrip(".")
        if not host:
            raise Refused("a webhook URL names a host")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise Refused("the webhook URL's port is not a number from 1 to 65535") from None
        with contextlib.suppress(ValueError):
            self.check_address(host, str(ipaddress.ip_address(host)))
        return scheme, host, port

    def check_address(self, host: str, address: str) -> None:
        if host in self.hosts:
            return
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if any(ip in n for n in self.networks):
            return
        if not is_public(address):
            raise Refused(
                f"{host} is {address}, a loopback, private, link-local or reserved address "
                "(GENQ_WEBHOOK_ALLOW_HOSTS opens one)"
            )

    async def resolve(self, url: str) -> Target:
        """The URL checked and resolved, every address it resolves to checked."""
        scheme, host, port = self.check_url(url)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise Refused(f"{host} does not resolve: {exc}") from None
        addresses = [str(info[4][0]) for info in infos]
        if not addresses:
            raise Refused(f"{host} has no address")
        for address in addresses:
            self.check_address(host, address)  # all of them: any could be the one used
        return Target(url, host, addresses[0], port, scheme)


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
        self._client: httpx.AsyncClient | None = None

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
        if self._client is not None:
            await self._client.aclose()
        if self.holding:
            with contextlib.suppress(RedisError, OSError):
                await self.scripts.run(self._lease("free"))
            self.holding = False

    async def round(self) -> bool:
        """One round: take or renew the lease; holding it, expand the outbox and send what is
        due. Whether it found a full page of either (more may be waiting)."""
        held = await self.scripts.run(
            self._lease("hold", int(self.settings.webhook_lease_s * 1000))
        )
        if held != self.holding:
            log.info("webhooks " + ("sent from here" if held else "no longer sent from here"))
            if held:
                await self._ensure_group()
        self.holding = held
        if not held:
            return False
        expanded = await self.expand()
        sent = await self.send_due()
        return expanded >= BATCH or sent >= self._page

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.webhook_outbox(), GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ---- outbox → deliveries ----------------------------------------------------------------

    async def expand(self) -> int:
        """New outbox entries (and any a dead holder left unacked), a page of them, into
        their deliveries; how many entries."""
        outbox = self.keys.webhook_outbox()
        entries: list[tuple[str, dict[str, str]]] = []
        idle_ms = int(self.settings.webhook_lease_s * 1000)  # read by a holder now gone
        with contextlib.suppress(ResponseError):
            claimed = await self.redis.xautoclaim(
                outbox, GROUP, self.consumer, idle_ms, "0-0", count=BATCH
            )
            entries += [(i, f) for i, f in claimed[1] if f]
        reply = await self.redis.xreadgroup(GROUP, self.consumer, {outbox: ">"}, count=BATCH)
        for _, got in reply or []:
            entries += [(i, f) for i, f in got if f]
        if not entries:
            return 0
        jobs = [f.get("job", "") for _, f in entries]
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in jobs:
                pipe.hmget(self.keys.job(job_id), *_JOB_FIELDS)
            records = await pipe.execute()
        async with self.redis.pipeline(transaction=True) as tx:  # the page's deliveries and
            now = time.time()  # acks at once: each entry becomes its deliveries exactly once
            for (entry_id, fields), record in zip(entries, records, strict=True):
                for d in self._deliveries_of(fields, record):
                    tx.hset(self.keys.webhook_delivery(d.id), mapping=_record(d))
                    tx.zadd(self.keys.webhook_due(), {d.id: now}, nx=True)
                tx.xack(outbox, GROUP, entry_id)
                tx.xdel(outbox, entry_id)
            await tx.execute()
        return len(entries)

    def _deliveries_of(self, fields: dict[str, str], job: list[str | None]) -> list[Delivery]:
        """The deliveries an outbox entry makes: its event to every endpoint that wants it
        (`job`: the job's `_JOB_FIELDS`, for a job's entry)."""
        now = time.time()
        targets: list[tuple[str, str]] = []  # (url, secret ref)
        if "batch" in fields:
            about = fields["batch"]
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
        body = event_body(about, kind, now)
        return [
            Delivery(delivery_id(event, url), url, secret, event, kind, body, now, 0)
            for url, secret in targets
        ]

    # ---- sending ----------------------------------------------------------------------------

    @property
    def _page(self) -> int:
        return self.settings.webhook_concurrency * PAGE_PER_SLOT

    async def send_due(self) -> int:
        """Send a page of the deliveries due, GENQ_WEBHOOK_CONCURRENCY at once; how many."""
        s, due = self.settings, self.keys.webhook_due()
        now = time.time()
        ids = await self.redis.zrangebyscore(due, "-inf", now, start=0, num=self._page)
        if not ids:
            return 0
        # the next attempt of each, should this holder die mid-delivery
        later = now + s.webhook_timeout_s * PAGE_PER_SLOT + s.webhook_lease_s
        await self.redis.zadd(due, {i: later for i in ids}, xx=True)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(self.keys.webhook_disabled())
            for did in ids:
                pipe.hgetall(self.keys.webhook_delivery(did))
            disabled, *records = await pipe.execute()
        slots = asyncio.Semaphore(s.webhook_concurrency)

        async def one(did: str, raw: dict[str, str]) -> None:
            async with slots:
                await self._attempt(did, raw, disabled)

        await asyncio.gather(*(one(i, r) for i, r in zip(ids, records, strict=True)))
        return len(ids)

    async def _attempt(self, did: str, raw: dict[str, str], disabled: set[str]) -> None:
        if not raw:
            await self.redis.zrem(self.keys.webhook_due(), did)
            return
        d = _delivery(did, raw)
        if d.url in disabled:
            await self._drop(d, "disabled", "the endpoint answered 410 Gone before")
            return
        secret = self._secret(d.secret)
        if secret is None:
            await self._drop(d, "dead", "its endpoint is no longer configured")
            return
        started = time.perf_counter()
        try:
            status = await self._post(d, secret)
            error = None if 200 <= status < 300 else f"answered {status}"
        except Refused as exc:
            status, error = 0, f"refused: {exc}"
            log.warning("webhook not sent", extra={"url": _shown(d.url), "reason": str(exc)})
        except (httpx.HTTPError, OSError, ValueError) as exc:
            status, error = 0, f"{type(exc).__name__}: {exc}"[:300]
        if self.metrics is not None:
            self.metrics.seconds.observe(time.perf_counter() - started)
        if error is None:
            await self._done(d)
        elif status == 410:
            await self.redis.sadd(self.keys.webhook_disabled(), d.url)
            await self._drop(d, "disabled", "410 Gone: the endpoint is disabled")
        else:
            await self._retry(d, error)

    def _secret(self, ref: str) -> str | None:
        s = self.settings
        if ref == JOB_SECRET:
            return s.webhook_secret.get_secret_value() if s.webhook_secret else None
        ep = next((e for e in s.webhooks if e.url == ref), None)
        return ep.secret.get_secret_value() if ep is not None else None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                timeout=httpx.Timeout(self.settings.webhook_timeout_s),
                # pooled by the checked address (the URL's host is it): a connection kept
                # alive goes to an address checked when it was opened
                limits=httpx.Limits(
                    max_connections=self.settings.webhook_concurrency,
                    max_keepalive_connections=self.settings.webhook_concurrency,
                ),
                trust_env=False,
            )
        return self._client

    async def _post(self, d: Delivery, secret: str) -> int:
        target = await self.guard.resolve(d.url)
        headers = {
            "content-type": "application/json",
            "user-agent": "genq-webhooks",
            "host": target.host if target.port in (80, 443) else f"{target.host}:{target.port}",
            **signed_headers(secret, d.event, d.body),
        }
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        limit = self.settings.webhook_max_response_bytes
        async with asyncio.timeout(self.settings.webhook_timeout_s):
            request = self._http().build_request(
                "POST", target.request_url(), content=d.body, headers=headers, extensions=extensions
            )
            response = await self._http().send(request, stream=True)
            try:
                read = 0
                async for chunk in response.aiter_raw():
                    read += len(chunk)
                    if read >= limit:
                        break  # the rest of an answer is never read
            finally:
                await response.aclose()
        return response.status_code

    async def _done(self, d: Delivery) -> None:
        async with self.redis.pipeline(transaction=True) as tx:
            tx.delete(self.keys.webhook_delivery(d.id))
            tx.zrem(self.keys.webhook_due(), d.id)
            await tx.execute()
        if self.metrics is not None:
            self.metrics.deliveries.labels("delivered").inc()
            self.metrics.delay.observe(max(0.0, time.time() - d.created_at))

    async def _retry(self, d: Delivery, error: str) -> None:
        s = self.settings
        now = time.time()
        if now - d.created_at > s.webhook_retry_window_s:
            await self._drop(d, "dead", f"out of retries after {d.attempts + 1}: {error}")
            return
        backoff = min(s.webhook_backoff_max_s, s.webhook_backoff_s * 2 ** min(d.attempts, 30))
        wait = backoff * random.uniform(0.5, 1.0)
        async with self.redis.pipeline(transaction=True) as tx:
            key = self.keys.webhook_delivery(d.id)
            tx.hset(key, mapping={"attempts": d.attempts + 1, "last_error": error})
            tx.zadd(self.keys.webhook_due(), {d.id: now + wait}, xx=True)
            await tx.execute()
        if self.metrics is not None:
            self.metrics.deliveries.labels("retried").inc()

    async def _drop(self, d: Delivery, outcome: str, why: str) -> None:
        log.warning(
            "webhook given up",
            extra={"url": _shown(d.url), "event": d.event, "type": d.kind, "reason": why},
        )
        async with self.redis.pipeline(transaction=True) as tx:
            tx.xadd(
                self.keys.webhook_dead(),
                {
                    "delivery": d.id,
                    "event": d.event,
                    "type": d.kind,
                    "url": d.url,
                    "attempts": d.attempts + 1,
                    "reason": why[:500],
                    "at": time.time(),
                },
                maxlen=DEAD_LETTERS_CAP,
                approximate=True,
            )
            tx.delete(self.keys.webhook_delivery(d.id))
            tx.zrem(self.keys.webhook_due(), d.id)
            await tx.execute()
        if self.metrics is not None:
            self.metrics.deliveries.labels(outcome).inc()


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
