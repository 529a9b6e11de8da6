"""Admission counters, shared by every gateway: what SUBMIT checks its limits against.

A job counts, in each of its scopes (its model's queue of its priority: all owners
together, and its owner alone), from SUBMIT (which checks the limits and counts it in the
same atomic step) to its end (EMIT of the end, or SETTLE, takes it off in their own step):
queued or running, not queued alone, so a key cannot exceed its share by having workers
take jobs off the queue faster than its limit. Counted per job are one job and its tokens
(prompt + max_tokens).

Drift: every count and uncount is atomic with the state change it follows, so a process
that dies mid-way leaves none. What remains is a job that ends unseen (by a worker older
than the counters, or a record deleted by hand): each admitted job is checked again every
`quota_recheck_s` (`due` then `release`), and one that ended, or is gone, stops counting.

Rates (token buckets on Redis's clock, one per owner and limit: prelude.lua): RATE_LIMIT
takes a request from the owner's request bucket and reads its tokens-per-minute bucket;
SUBMIT takes the job's tokens from the latter in the step that queues it, so a refused or
re-sent submit costs nothing. A bucket rather than a sliding window: O(1) state per owner
(a window keeps an entry per request, or, counted per minute, lets twice the limit through
across a minute's edge), and its level tells a client exactly when the next request fits.

On a Cluster the counters are striped: each queue shard's slot holds a stripe (`Keys.stripes`),
and each stripe admits up to its share of every limit (`share`: the limit over the stripes,
the remainder to the first ones), so the shares add up to the limit and the fleet never
holds more. SUBMIT counts a job in a step of its own (ADMIT) before the job's record: in its
own shard's stripe, or, refused there, in the next stripe that has room; a submit is refused
only when every stripe refuses it. A job's end uncounts it in a step after
(ADMISSION_RELEASE, in its own stripe first, then the others: idempotent, and the repair,
stripe by stripe, catches a step lost in between). What striping costs: a job needs room in
one stripe, so one job over a stripe's share of a tokens limit (1/GENQ_QUEUE_SHARDS of it)
is refused as one no limit could ever admit; and the owner's fair share is checked against
the stripe's share of it. A job's tokens-per-minute charge is a step before its admission
(CHARGE, in the owner's slot with its request bucket), given back (REFUND) when a later step
refuses the job.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from shared import scripts as lua
from shared.keys import Keys
from shared.transitions import Bucket, Call, call

NO_SHARE = -1
"""A stripe's share of a limit smaller than the stripes: nothing (0 would read as no limit)."""


def share(limit: int, stripe: int, stripes: int) -> int:
    """Stripe `stripe`'s share of `limit` (0: none) among `stripes`: the shares add up to
    the limit, the remainder going to the first stripes (so stripe 0 holds the most of
    every limit, and a job that fits no stripe fits none); NO_SHARE where it is nothing."""
    if not limit or stripes == 1:
        return limit
    return limit // stripes + (1 if stripe < limit % stripes else 0) or NO_SHARE


@dataclass(frozen=True, slots=True)
class Quota:
    """One scope of a job's admission: its counter fields and limits (0 = none)."""

    jobs_field: str
    tokens_field: str
    max_jobs: int = 0
    max_tokens: int = 0

    def at(self, stripe: int, stripes: int) -> Quota:
        """This scope as admission stripe `stripe` of `stripes` checks it: its share of each
        limit."""
        return Quota(
            self.jobs_field,
            self.tokens_field,
            share(self.max_jobs, stripe, stripes),
            share(self.max_tokens, stripe, stripes),
        )

    def room(self, tokens: int) -> bool:
        """Whether this scope, holding nothing, would admit a job of `tokens` (a limit of 0
        is none; NO_SHARE admits nothing)."""
        return self.max_jobs != NO_SHARE and (not self.max_tokens or tokens <= self.max_tokens)


@dataclass(frozen=True, slots=True)
class Admission:
    """What SUBMIT counts a job as, where, and when the repair first looks at it."""

    tokens: int
    check_at: float
    quotas: tuple[Quota, ...] = field(default_factory=tuple)
    fair_field: str = ""
    """The owner's jobs counter: past `fair_share` jobs in flight, the job waits in the
    overflow stream (0: every job in the queue)."""
    fair_share: int = 0
    fair_cost: float | None = None
    """Token-fair scheduling: what the job costs its owner in virtual time (tokens / the
    owner's weight); None: the job goes straight to the queue."""
    fair_owner: str = ""
    fair_window: int = 1
    charge: TokenCharge | None = None

    def fair_share_of(self, stripes: int) -> int:
        """The owner's fair share as one stripe checks it (its jobs there against the
        stripe's part of the share: each stripe holds about 1/`stripes` of them)."""
        if not self.fair_share:
            return 0
        return -(-self.fair_share // stripes)

    def stripe_quotas(self, stripe: int, stripes: int) -> tuple[Quota, ...] | None:
        """The scopes as stripe `stripe` of `stripes` checks them; None when this job could
        never fit that stripe's shares (not worth a call)."""
        quotas = tuple(q.at(stripe, stripes) for q in self.quotas)
        if stripes > 1 and not all(q.room(self.tokens) for q in quotas):
            return None
        return quotas


@dataclass(frozen=True, slots=True)
class TokenCharge:
    """What admitting a job takes from its owner's tokens-per-minute bucket (SUBMIT takes it
    in the step that queues the job, or refuses the job with nothing taken)."""

    bucket: str
    """The bucket's key (`Keys.tokens_rate`)."""
    tokens: int
    tpm: int
    """The bucket's size: the owner's tokens per minute, refilled over a minute."""


@dataclass(frozen=True, slots=True)
class RateReply:
    """A request counted against its owner's request rate, and its buckets as they are now
    (None: no such limit)."""

    allowed: bool
    retry_after_ms: int
    requests: Bucket | None
    tokens: Bucket | None


def _rate_reply(burst: int, tpm: int, r: list[Any]) -> RateReply:
    requests = Bucket(burst, int(r[2]), int(r[3])) if int(r[2]) >= 0 else None
    tokens = Bucket(tpm, int(r[4]), int(r[5])) if int(r[4]) >= 0 else None
    return RateReply(bool(int(r[0])), int(r[1]), requests, tokens)


class QuotaCalls:
    """Builds the calls of the admission scripts (besides SUBMIT, EMIT, SETTLE)."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def counter_keys(self) -> list[str]:
        k = self.keys
        return [
            key
            for i in k.stripes
            for key in (k.admission_counts(i), k.admission_jobs(i), k.admission_checks(i))
        ]

    def rate_limit(self, owner: str, *, rate: float, burst: int, tpm: int) -> Call[RateReply]:
        """One request of `owner` against `rate` a second (0: none) in bursts of `burst`, and
        its tokens bucket of `tpm` (0: none) read."""
        k = self.keys
        return call(
            lua.RATE_LIMIT,
            functools.partial(_rate_reply, burst, tpm),
            {"requests": k.rate_limit(owner), "tokens": k.tokens_rate(owner)},
            {"rate": repr(rate), "burst": burst, "tpm": tpm},
        )

    def due(self, *, now: float, next_check: float, limit: int, stripe: int = 0) -> Call[list[str]]:
        return call(
            lua.ADMISSION_DUE,
            lambda r: [str(x) for x in r],
            {"checks": self.keys.admission_checks(stripe)},
            {"now": repr(now), "next_at": repr(next_check), "limit": limit},
            cluster=self.keys.cluster,
        )

    def release(self, job_key: str, stripe: int = 0) -> Call[bool]:
        k = self.keys
        keys = {
            "counts": k.admission_counts(stripe),
            "jobs": k.admission_jobs(stripe),
            "checks": k.admission_checks(stripe),
        }
        return call(
            lua.ADMISSION_RELEASE,
            lambda r: bool(int(r)),
            keys,
            {"job_key": job_key},
            cluster=self.keys.cluster,
        )
