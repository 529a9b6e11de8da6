"""Webhooks: what genq tells an app when its job, response or batch ends.

The event is OpenAI's shape (`id`, `object: event`, `type`, `created_at`, `data: {id}`), signed
as the Standard Webhooks spec says and as OpenAI signs its own: `webhook-id` (the event's id),
`webhook-timestamp` (Unix seconds), `webhook-signature: v1,<base64 HMAC-SHA256 over
"{id}.{timestamp}.{body}">` with the secret's key (a `whsec_` secret is the base64 of the
key), so the OpenAI SDK's `client.webhooks.unwrap()` verifies a genq delivery unchanged.

An event's id is a hash of what it is about and its type: the same end gives the same id on
every attempt and from every gateway, so a receiver drops repeats by it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import time
from typing import Literal

JOB_EVENTS = ("job.succeeded", "job.failed", "job.cancelled", "job.expired")
RESPONSE_EVENTS = (
    "response.completed",
    "response.failed",
    "response.cancelled",
    "response.incomplete",
)
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")
EVENT_TYPES = frozenset(JOB_EVENTS + RESPONSE_EVENTS + BATCH_EVENTS)
EventType = Literal[
    "job.succeeded",
    "job.failed",
    "job.cancelled",
    "job.expired",
    "response.completed",
    "response.failed",
    "response.cancelled",
    "response.incomplete",
    "batch.completed",
    "batch.failed",
    "batch.expired",
    "batch.cancelled",
]
SECRET_PREFIX = "whsec_"


def job_event_type(status: str) -> str | None:
    """The native job's event for its final status."""
    return f"job.{status}" if f"job.{status}" in JOB_EVENTS else None


def response_event_type(status: str, finish_reason: str | None) -> str | None:
    """A Responses API response's event for its job's final status."""
    if status == "succeeded":
        return "response.incomplete" if finish_reason == "length" else "response.completed"
    if status in ("failed", "expired"):
        return "response.failed"
    if status == "cancelled":
        return "response.cancelled"
    return None


def batch_event_type(status: str) -> str | None:
    return f"batch.{status}" if f"batch.{status}" in BATCH_EVENTS else None


def event_id(about: str, kind: str) -> str:
    """The stable id of the event `kind` about `about` (a job, response or batch id)."""
    return "evt_" + hashlib.sha256(f"{about}\0{kind}".encode()).hexdigest()[:32]


def event_body(about: str, kind: str, created_at: float, event: str | None = None) -> bytes:
    """The event as sent: compact JSON (`event`: its id, where it is at hand)."""
    body = {
        "id": event or event_id(about, kind),
        "object": "event",
        "type": kind,
        "created_at": int(created_at),
        "data": {"id": about},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a secret: a `whsec_` secret's base64 decoded, another's bytes as is."""
    if secret.startswith(SECRET_PREFIX):
        return base64.b64decode(secret[len(SECRET_PREFIX) :])
    return secret.encode()


def check_secret(secret: str) -> str:
    """ValueError for a secret that cannot sign: a `whsec_` one whose key is not base64."""
    try:
        key = secret_key(secret)
    except ValueError:
        raise ValueError("a whsec_ secret is whsec_ and the base64 of its key") from None
    if len(key) < 16:
        raise ValueError("a webhook secret's key is at least 16 bytes")
    return secret


def sign(key: bytes, event: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The Standard Webhooks headers for `body`, the event of id `event`, signed with a
    secret's key (`secret_key`)."""
    ts = str(int(time.time() if now is None else now))
    mac = hmac.digest(key, f"{event}.{ts}.".encode() + body, "sha256")
    return {
        "webhook-id": event,
        "webhook-timestamp": ts,
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }


def delivery_id(event: str, url: str) -> str:
    return hashlib.sha256(f"{event}\0{url}".encode()).hexdigest()[:32]


def is_public(address: str) -> bool:
    """Whether an address may be connected to without an allow-list: a global unicast one
    (not loopback, private, link-local — the cloud metadata address among them — multicast,
    reserved, shared or unspecified; an IPv4-mapped IPv6 address is judged as its IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return bool(ip.is_global) and not ip.is_multicast
