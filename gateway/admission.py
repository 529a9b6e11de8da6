"""Admission control: whether a request may add work now. Queue limits and per-key quotas
(429), the per-key request rate (429), and Redis memory (503), each with `Retry-After`.

The limits themselves are checked where they cannot be overshot: in SUBMIT, atomically with
the job's counting (shared/quotas.py). `precheck` reads the same counters first, so a request
the limits will refuse is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from gateway.identity import Identity
from shared.errors import BadRequest, TooManyRequests, Unavailable
from shared.keys import Keys, Priority, scope_fields
from shared.loops import keep_running
from shared.quotas import Admission, Quota, QuotaCalls
from shared.schemas import JobSpec
from shared.settings import GatewaySettings
from shared.transitions import Limited, ScriptRunner

log = logging.getLogger(__name__)

REPAIR_BATCH = 500
"""Admitted jobs one repair round checks."""
REPAIR_ROUNDS = 10
"""Most rounds per repair tick: a backlog of due checks is worked off over several ticks."""
_LIVE = frozenset({"queued", "running"})
_MS_PER_S = 1000


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

    def admission(self, caller: Identity, spec: JobSpec, cached_tokens: int = 0) -> Admission:
        """What SUBMIT counts `spec` as, and against which limits; a 400 for a job no limit
        could ever admit. `cached_tokens`: of its prompt, what a worker's cache holds (a
        placement estimate), not charged as prefill by token-fair scheduling."""
        tokens = len(spec.input_ids) + spec.max_tokens
        scopes = self._scopes(caller, spec.priority, spec.model)
        for sc in scopes:
            if sc.tokens.value and tokens > sc.tokens.value:
                raise BadRequest(
                    f"this job needs {tokens} tokens (prompt + max_tokens), over the "
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
        )

    def fair_cost(self, caller: Identity, spec: JobSpec, cached_tokens: int = 0) -> float:
        """What a job costs its owner under token-fair scheduling: the tokens it may generate,
        plus its uncached prompt tokens at GENQ_FAIR_PREFILL_WEIGHT each, over the owner's
        weight (its key's, 1 by default)."""
        uncached = max(0, len(spec.input_ids) - cached_tokens)
        cost = spec.max_tokens + uncached * self.settings.fair_prefill_weight
        return cost / caller.weight

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
        tokens = len(spec.input_ids) + spec.max_tokens
        return self._full(sc, spec.priority, spec.model, limited.what, limited.count, tokens)

    async def precheck(self, caller: Identity, model: str, priority: Priority, jobs: int) -> None:
        """Refuse early what the limits would refuse anyway: Redis nearly full (503), a scope
        without room for `jobs` more jobs (429; 400 if it never could have). Tokens are
        SUBMIT's to check."""
        await self.check_memory()
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
        fields = [sc.fields[0] for sc in limited]
        counts = await self.redis.hmget(self.keys.admission_counts(), fields)
        for sc, count in zip(limited, counts, strict=True):
            n = int(count or 0)
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

    async def check_rate(self, caller: Identity) -> None:
        """429 past the key's request rate (GENQ_RATE_LIMIT_PER_KEY); only while keys are set."""
        s = self.settings
        if not s.rate_limit_per_key or not caller.keyed:
            return
        burst = s.rate_limit_burst or max(1, math.ceil(s.rate_limit_per_key))
        call = self.calls.rate_limit(caller.owner, rate=s.rate_limit_per_key, burst=burst)
        reply = await self.scripts.run(call)
        if not reply.allowed:
            raise TooManyRequests(
                f"this API key is over its request rate of {s.rate_limit_per_key:g}/s "
                f"(GENQ_RATE_LIMIT_PER_KEY, bursts of {burst}); retry later",
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
        for _ in range(REPAIR_ROUNDS):
            now = time.time()
            call = self.calls.due(
                now=now, next_check=now + self.settings.quota_recheck_s, limit=REPAIR_BATCH
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
                replies = await self.scripts.run_all([self.calls.release(k) for k in ended])
                released += sum(r is True for r in replies)
            if len(due) < REPAIR_BATCH:
                break
        if released:
            log.warning("admission counters repaired", extra={"released": released})
        return released

    async def repair_loop(self) -> None:
        await keep_running(
            self.repair,
            failed="admission repair failed",
            log=log,
            every_s=self.settings.quota_repair_s,
        )
