"""Admission control: whether a request may add work now. Queue limits and per-key quotas
(429), the per-key request rate and tokens per minute (429), and Redis memory (503), each
with `Retry-After`.

The limits themselves are checked where they cannot be overshot: in SUBMIT, atomically with
the job's counting and its tokens' charge (shared/quotas.py). `precheck` reads the same
counters first, and the tokens bucket as the request rate's check read it, so a request the
limits will refuse is refused before it is tokenized. What the rate checks read of the key's
buckets is told to the client in OpenAI's headers (gateway/rate_headers.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from gateway import rate_headers
from gateway.identity import Identity
from shared.errors import BadRequest, TooManyRequests, Unavailable
from shared.keys import Keys, Priority, scope_fields
from shared.loops import keep_running
from shared.quotas import Admission, Quota, QuotaCalls, TokenCharge, share
from shared.schemas import JobSpec
from shared.settings import GatewaySettings
from shared.transitions import Limited, ScriptRunner, Throttled

log = logging.getLogger(__name__)

REPAIR_BATCH = 500
"""Admitted jobs one repair round checks."""
REPAIR_ROUNDS = 10
"""Most rounds per repair tick: a backlog of due checks is worked off over several ticks."""
_LIVE = frozenset({"queued", "running"})
_MS_PER_S = 1000
_S_PER_MINUTE = 60
_FROM_KEYS_FILE = "its {}= in the keys file"


def job_cost(spec: JobSpec) -> int:
    """What a job counts as against the token limits: its prompt and max_tokens (as OpenAI
    counts max_tokens against tokens per minute when a request is admitted)."""
    return len(spec.input_ids) + spec.max_tokens


@dataclass(frozen=True, slots=True)
class MemoryState:
    """Redis's memory as INFO reports it; `max_bytes` 0: no maxmemory (no limit)."""

    used_bytes: int
    max_bytes: int
    policy: str

    @property
    def fraction(self) -> float | None:
        return self.used_bytes / self.max_bytes if self.max_bytes else None


@dataclass(frozen=True, slots=True)
class _Limit:
    setting: str
    value: int
    """0: none."""


@dataclass(frozen=True, slots=True)
class _Rates:
    """A key's request rate and tokens per minute (0: no limit), each with where it is set."""

    per_s: float
    burst: int
    per_s_setting: str
    tpm: int
    tpm_setting: str


_NO_RATES = _Rates(0.0, 0, "", 0, "")


@dataclass(frozen=True, slots=True)
class _Scope:
    """A model's queue of one priority, for everyone or for one owner (`own`)."""

    fields: tuple[str, str]
    jobs: _Limit
    tokens: _Limit
    own: bool


class AdmissionControl:
    def __init__(
        self, settings: GatewaySettings, redis: Any, scripts: ScriptRunner, keys: Keys
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.calls = QuotaCalls(keys)
        self._memory: tuple[float, MemoryState] | None = None
        self._memory_lock = asyncio.Lock()
        self._memory_unknown_logged = False

    # ---- queue limits and quotas ----------------------------------------------------------

    def admission(
        self, caller: Identity, spec: JobSpec, charge: int = 0, cached_tokens: int = 0
    ) -> Admission:
        """What SUBMIT counts `spec` as, and against which limits, charging `charge` tokens to
        the caller's tokens per minute; a 400 for a job no limit could ever admit.
        `cached_tokens`: of its prompt, what a worker's cache holds (a placement estimate),
        not charged as prefill by token-fair scheduling."""
        tokens = job_cost(spec)
        scopes = self._scopes(caller, spec.priority, spec.model)
        stripes = len(self.keys.stripes)
        for sc in scopes:
            if sc.tokens.value and tokens > sc.tokens.value:
                raise BadRequest(
                    f"this job needs {tokens} tokens (prompt + max_tokens), over the "
                    f"{sc.tokens.setting} limit of {sc.tokens.value} for {spec.priority} jobs",
                    param="max_tokens",
                )
            most = share(sc.tokens.value, 0, stripes)
            if sc.tokens.value and tokens > most:
                raise BadRequest(
                    f"this job needs {tokens} tokens (prompt + max_tokens), over the {most} "
                    f"that one of the {stripes} queue shards (GENQ_QUEUE_SHARDS) admits of the "
                    f"{sc.tokens.setting} limit of {sc.tokens.value} for {spec.priority} jobs",
                    param="max_tokens",
                )
        quotas = tuple(Quota(*sc.fields, sc.jobs.value, sc.tokens.value) for sc in scopes)
        own = next(sc for sc in scopes if sc.own)
        s = self.settings
        by_tokens = s.fair_scheduling == "tokens" and caller.keyed
        return Admission(
            tokens,
            time.time() + s.quota_recheck_s,
            quotas,
            fair_field=own.fields[0],
            # with the API open everyone is one owner: no one to be fair to
            fair_share=s.fair_share_jobs if caller.keyed and not by_tokens else 0,
            fair_cost=self.fair_cost(caller, spec, cached_tokens) if by_tokens else None,
            fair_owner=caller.owner,
            fair_window=s.fair_window,
            charge=self._charge(caller, charge),
        )

    def fair_cost(self, caller: Identity, spec: JobSpec, cached_tokens: int = 0) -> float:
        """What a job costs its owner under token-fair scheduling: the tokens it may generate,
        plus its uncached prompt tokens at GENQ_FAIR_PREFILL_WEIGHT each, over the owner's
        weight (its key's: the keys file's `weight=`, else GENQ_KEY_WEIGHTS, else 1)."""
        uncached = max(0, len(spec.input_ids) - cached_tokens)
        cost = spec.max_tokens + uncached * self.settings.fair_prefill_weight
        return cost / caller.weight

    def _charge(self, caller: Identity, tokens: int) -> TokenCharge | None:
        """`tokens` to take from the caller's tokens per minute; a 400 past the most its
        bucket holds (a minute's worth: waiting would never let them in)."""
        rates = self._rates(caller)
        if not tokens or not rates.tpm:
            return None
        if tokens > rates.tpm:
            raise BadRequest(
                f"this request needs {tokens} tokens (prompt + max_tokens), more than this API "
                f"key's limit of {rates.tpm} tokens per minute ({rates.tpm_setting}) allows at "
                "once; lower max_tokens or shorten the prompt",
                param="max_tokens",
            )
        return TokenCharge(self.keys.tokens_rate(caller.owner), tokens, rates.tpm)

    def _scopes(self, caller: Identity, priority: Priority, model: str) -> list[_Scope]:
        """The model's queue of this priority for everyone, then for the caller (counted
        always, limited only while API keys are set: with the API open, one owner is all)."""
        s = self.settings
        jobs = _Limit("GENQ_MAX_QUEUED_JOBS", s.max_queued_jobs.of(priority))
        depth = s.openai_max_queue_depth
        if priority == "interactive" and depth and (not jobs.value or depth < jobs.value):
            jobs = _Limit("GENQ_OPENAI_MAX_QUEUE_DEPTH", depth)
        tokens = _Limit("GENQ_MAX_QUEUED_TOKENS", s.max_queued_tokens.of(priority))
        keyed = caller.keyed
        own_jobs = s.max_queued_jobs_per_key.of(priority) if keyed else 0
        own_tokens = s.max_queued_tokens_per_key.of(priority) if keyed else 0
        return [
            _Scope(scope_fields(priority, model), jobs, tokens, own=False),
            _Scope(
                scope_fields(priority, model, caller.owner),
                _Limit("GENQ_MAX_QUEUED_JOBS_PER_KEY", own_jobs),
                _Limit("GENQ_MAX_QUEUED_TOKENS_PER_KEY", own_tokens),
                own=True,
            ),
        ]

    def refusal(self, caller: Identity, spec: JobSpec, limited: Limited) -> TooManyRequests:
        """The 429 for a SUBMIT that found a scope full."""
        sc = self._scopes(caller, spec.priority, spec.model)[limited.scope]
        need = job_cost(spec)
        return self._full(sc, spec.priority, spec.model, limited.what, limited.count, need)

    def throttled(self, caller: Identity, charge: int, reply: Throttled) -> TooManyRequests:
        """The 429 for a SUBMIT that found the caller's tokens per minute short of `charge`."""
        left = reply.tokens.remaining
        why = f"this request needs {charge} tokens (prompt + max_tokens) and {left} are left"
        return self._over_tokens(self._rates(caller), why, reply.retry_after_ms)

    def _over_tokens(self, rates: _Rates, why: str, retry_after_ms: int) -> TooManyRequests:
        return TooManyRequests(
            f"this API key is over its limit of {rates.tpm} tokens per minute "
            f"({rates.tpm_setting}): {why}; retry later",
            code="rate_limited",
            retry_after_s=max(1, math.ceil(retry_after_ms / _MS_PER_S)),
        )

    async def precheck(self, caller: Identity, model: str, priority: Priority, jobs: int) -> None:
        """Refuse early what the limits would refuse anyway: Redis nearly full (503), a key
        without a token left of its tokens per minute (429: as the request rate's check read
        its bucket), a scope without room for `jobs` more jobs (429; 400 if it never could
        have). How many tokens the request needs is SUBMIT's to check."""
        await self.check_memory()
        tokens = rate_headers.seen().tokens
        if tokens is not None and tokens.remaining < 1:
            rates = self._rates(caller)
            wait_ms = math.ceil(_S_PER_MINUTE * _MS_PER_S / max(1, rates.tpm))
            raise self._over_tokens(rates, "none are left", wait_ms)
        limited = [sc for sc in self._scopes(caller, priority, model) if sc.jobs.value]
        if not limited:
            return
        for sc in limited:
            if jobs > sc.jobs.value:
                raise BadRequest(
                    f"this request makes {jobs} jobs (n x prompts), more than the "
                    f"{sc.jobs.setting} limit of {sc.jobs.value} {priority} jobs",
                    param="n",
                )
        if jobs == 1 and len(self.keys.stripes) > 1:
            return  # ADMIT refuses one job as early, without reading every stripe first
        fields = [sc.fields[0] for sc in limited]
        held = [0] * len(fields)
        pipe = self.redis.pipeline(transaction=False)
        for stripe in self.keys.stripes:  # on a cluster, what the stripes hold together
            pipe.hmget(self.keys.admission_counts(stripe), fields)
        for counts in await pipe.execute():
            held = [h + int(c or 0) for h, c in zip(held, counts, strict=True)]
        for sc, n in zip(limited, held, strict=True):
            if n + jobs > sc.jobs.value:
                raise self._full(sc, priority, model, "jobs", n, jobs)

    def _full(
        self, sc: _Scope, priority: Priority, model: str, what: str, count: int, need: int
    ) -> TooManyRequests:
        """`need`: the jobs (or tokens) the request would add."""
        holder = "this API key" if sc.own else f"model '{model}'"
        where = f" for model '{model}'" if sc.own else ""
        if what == "jobs":
            limit = sc.jobs
            held = f"{count} {priority} jobs queued or running{where}"
            held += f", and this request makes {need}" if need > 1 else ""
        else:
            limit = sc.tokens
            held = (
                f"{count} tokens (prompt + max_tokens) of {priority} jobs queued or running"
                f"{where}, and this job needs {need}"
            )
        return TooManyRequests(
            f"{holder} has {held}; the limit ({limit.setting}) is {limit.value}; retry later",
            param="max_tokens" if what == "tokens" else None,
            code="quota_exceeded" if sc.own else "queue_full",
            retry_after_s=self.settings.retry_after_s,
        )

    # ---- request rate ---------------------------------------------------------------------

    def _rates(self, caller: Identity) -> _Rates:
        """The caller's limits: its key's own (keys file), else the settings'; none while the
        API is open."""
        if not caller.keyed:
            return _NO_RATES
        s, own = self.settings, caller.options
        if own.rpm is None:
            per_s, per_s_setting = s.rate_limit_per_key, "GENQ_RATE_LIMIT_PER_KEY"
        else:
            per_s, per_s_setting = own.rpm / _S_PER_MINUTE, _FROM_KEYS_FILE.format("rpm")
        if own.tpm is None:
            tpm, tpm_setting = s.tokens_per_minute_per_key, "GENQ_TOKENS_PER_MINUTE_PER_KEY"
        else:
            tpm, tpm_setting = own.tpm, _FROM_KEYS_FILE.format("tpm")
        burst = s.rate_limit_burst or max(1, math.ceil(per_s))
        return _Rates(per_s, burst, per_s_setting, tpm, tpm_setting)

    async def check_rate(self, caller: Identity) -> None:
        """One request of the caller against its request rate (429 past it), its tokens per
        minute read for `precheck` and the headers; only while keys are set. Both buckets,
        shared by all gateways, in one script call."""
        rates = self._rates(caller)
        if not rates.per_s and not rates.tpm:
            return
        call = self.calls.rate_limit(
            caller.owner, rate=rates.per_s, burst=rates.burst, tpm=rates.tpm
        )
        reply = await self.scripts.run(call)
        rate_headers.note(reply.requests, reply.tokens)
        if not reply.allowed:
            raise TooManyRequests(
                f"this API key is over its request rate of {rates.per_s * _S_PER_MINUTE:g} "
                f"requests per minute ({rates.per_s:g}/s, in bursts of {rates.burst}; "
                f"{rates.per_s_setting}); retry later",
                code="rate_limited",
                retry_after_s=max(1, math.ceil(reply.retry_after_ms / _MS_PER_S)),
            )

    # ---- Redis memory ---------------------------------------------------------------------

    async def memory(self) -> MemoryState:
        """Redis's memory, read at most once per GENQ_REDIS_MEMORY_CHECK_S in this process."""
        async with self._memory_lock:
            hit = self._memory
            if hit is not None and time.monotonic() - hit[0] < self.settings.redis_memory_check_s:
                return hit[1]
            try:
                info = await self.redis.info("memory")
            except ResponseError as exc:  # a Redis that does not say (fakeredis): no limit known
                if not self._memory_unknown_logged:
                    log.info("Redis reports no memory use; not checked", extra={"error": str(exc)})
                    self._memory_unknown_logged = True
                info = {}
            state = MemoryState(
                int(info.get("used_memory", 0)),
                int(info.get("maxmemory", 0)),
                str(info.get("maxmemory_policy", "")),
            )
            self._memory = (time.monotonic(), state)
            return state

    async def check_memory(self) -> None:
        """503 while Redis uses GENQ_REDIS_MEMORY_LIMIT of its maxmemory or more: new work
        is refused before Redis refuses writes (and the jobs already accepted can end)."""
        limit = self.settings.redis_memory_limit
        if not limit:
            return
        mem = await self.memory()
        if mem.fraction is not None and mem.fraction >= limit:
            raise Unavailable(
                f"Redis is nearly out of memory ({mem.fraction:.0%} of its maxmemory used; "
                f"new jobs are refused from {limit:.0%}, GENQ_REDIS_MEMORY_LIMIT); retry later",
                code="redis_memory_full",
                retry_after_s=self.settings.retry_after_s,
            )

    # ---- repair ---------------------------------------------------------------------------

    async def repair(self) -> int:
        """Check the admitted jobs due a check; those ended unseen (or gone) stop counting.
        How many were released."""
        released = 0
        for stripe in self.keys.stripes:
            released += await self._repair_stripe(stripe)
        if released:
            log.warning("admission counters repaired", extra={"released": released})
        return released

    async def _repair_stripe(self, stripe: int) -> int:
        released = 0
        for _ in range(REPAIR_ROUNDS):
            now = time.time()
            call = self.calls.due(
                now=now,
                next_check=now + self.settings.quota_recheck_s,
                limit=REPAIR_BATCH,
                stripe=stripe,
            )
            due = await self.scripts.run(call)
            if not due:
                break
            pipe = self.redis.pipeline(transaction=False)
            for job_key in due:
                pipe.hget(job_key, "status")
            statuses = await pipe.execute()
            # An ended status is final and a job's id is never reused: checking first and
            # releasing after cannot release a live job.
            ended = [k for k, st in zip(due, statuses, strict=True) if st not in _LIVE]
            if ended:
                calls = [self.calls.release(k, stripe) for k in ended]
                replies = await self.scripts.run_all(calls)
                released += sum(r is True for r in replies)
            if len(due) < REPAIR_BATCH:
                break
        return released

    async def repair_loop(self) -> None:
        await keep_running(
            self.repair,
            failed="admission repair failed",
            log=log,
            every_s=self.settings.quota_repair_s,
        )
