"""The job's state transitions: the Lua scripts in `shared/lua/`, behind typed calls.

Each method builds a `Call` (keys, arguments, and how to read the reply) from named
arguments; `ScriptRunner` runs calls, one or a pipeline of many, by EVALSHA. Every script
touches the keys of one job (one Cluster slot) and, besides them, only: SUBMIT its queue, the
deadlines index, the idempotency key and the admission counters; EMIT and SETTLE the
admission counters and the deadlines index when the job ends (shared/quotas.py), and the done
stream of a batch's job (its record names it); TOUCH the queue it checks; SUBMIT, EMIT and
SETTLE the recent-jobs stream (the dashboard's); EMIT and SETTLE add an ended job to the
compaction index, COMPACT takes it off. On a cluster those run as steps (below).

Who may write a job (fencing): the gateway while it is `queued` and nobody runs it (SUBMIT,
SETTLE of a cancel), the worker the record names at the record's `attempt` while it is
`running` (EMIT, HAND_BACK; the one ownership check is `owns` in prelude.lua). Event ids
are `0-<seq>`, so a replayed write fails instead of duplicating.

A Redis that restarted forgets its scripts: a call answered NOSCRIPT did not run, so the
runner loads the scripts again and re-sends exactly those calls.

On a Redis Cluster (`Keys.cluster`) a script may touch one slot only, so what spans slots
runs as steps: a `Call` whose `then` makes the next step from this one's reply. The order is
the one that leaves nothing a reader could mistake if a process stops between two steps:
- SUBMIT: the idempotency claim, the admission count, the queue entry kept as pending in the
  job's queue shard, the record and first event in the job's slot, then the queue entry
  written (and the pending one removed, in one script). A crash before the record leaves a
  claim and a count the admission repair gives back; a crash after it, a job the reconciler
  queues (gateway/deadline_sweep.py); never a queue entry without its job, and the pending
  entry's removal makes the job queued exactly once.
- EMIT / SETTLE of an end: the end written in the job's slot first (from then on the job is
  ended for every reader), then its shard's indexes and queue entry, the admission counters,
  the batch's done stream and the webhook outbox. A crash between leaves what the sweeps
  repair: the admission repair, the deadline sweep (an ended job leaves its index), the
  reclaim (a START of an ended job acknowledges its entry).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from redis.exceptions import NoScriptError

from shared import scripts as lua
from shared.errors import Unavailable
from shared.keys import CONSUMER_GROUP, Keys, Priority
from shared.records import JobRecord, QueueEntry
from shared.scripts import DECLARED, Arg, ScriptArgs
from shared.settings import JobSettings

if TYPE_CHECKING:
    from shared.quotas import Admission

R = TypeVar("R")
RECENT_JOBS: int = JobSettings.model_fields["recent_jobs"].default
COMPACT_GRACE_S: int = JobSettings.model_fields["event_compact_grace_s"].default
EncodedEvent = tuple[int, str]
"""(seq, the event's JSON) as `shared.events.encode` made it."""


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str = field(init=False)
    """SHA1 of the source, as EVALSHA names it: hashed once (a flush sends hundreds of calls)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


_PUBLISH = "local PUB = 'PUBLISH'"


@cache
def script(name: str, cluster: bool = False) -> Script:
    """`shared/lua/<name>.lua` with the prelude before it, then the prologue that unpacks its
    declared KEYS and ARGV by name (`shared.scripts`). `cluster`: a job's events are
    published with SPUBLISH (sharded pub/sub) instead of PUBLISH."""
    lua = resources.files("shared") / "lua"
    prelude = (lua / "prelude.lua").read_text(encoding="utf-8")
    if cluster:
        prelude = prelude.replace(_PUBLISH, "local PUB = 'SPUBLISH'")
    prologue = DECLARED[name].prologue()
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    return Script(name, prelude + "\n" + prologue + body)


@dataclass(frozen=True)
class Call(Generic[R]):
    script: Script
    keys: list[str]
    args: list[Arg]
    parse: Callable[[Any], R]
    then: Callable[[Any], Call[R] | None] | None = None
    """Cluster: the next step, made from this step's raw reply (None: this was the last,
    and `parse` reads its reply)."""

    def next(self, raw: Any) -> Call[R] | None:
        return None if self.then is None else self.then(raw)


def call(
    declared: ScriptArgs,
    parse: Callable[[Any], R],
    keys: Mapping[str, str],
    argv: Mapping[str, Arg] | None = None,
    rest: Sequence[Arg] = (),
    *,
    cluster: bool = False,
    then: Callable[[Any], Call[R] | None] | None = None,
) -> Call[R]:
    """A call of the script `declared` names, its KEYS and ARGV given by their declared
    names (ValueError for a missing or unknown one)."""
    key_list, args = declared.pack(keys, argv, rest)
    return Call(script(declared.name, cluster), key_list, args, parse, then)


def steps(calls: Sequence[Call[Any]], result: R) -> Call[R] | None:
    """`calls` run one after another whatever each answers, then `result` (Cluster: the
    parts of a step done in other slots)."""
    if not calls:
        return None
    first, rest = calls[0], calls[1:]

    def then(raw: Any) -> Call[R] | None:
        more = first.next(raw)  # a step of its own steps first (a release's next stripe)
        return steps([more, *rest] if more is not None else rest, result)

    return Call(first.script, first.keys, first.args, lambda _raw: result, then)


# ---- replies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    attempt: int
    last_seq: int
    spec: str
    """The record's spec as stored (decoded by the caller: a damaged one fails that job)."""
    cancel: str | None


@dataclass(frozen=True)
class Exhausted:
    """Out of attempts: nothing was written; the caller settles the job as failed."""

    attempt: int
    last_seq: int
    status: str
    last_error: str | None


@dataclass(frozen=True)
class Interrupted:
    """Stops interrupted it more often than allowed: nothing was written; the caller settles
    the job as failed."""

    attempt: int
    last_seq: int
    status: str
    interruptions: int


@dataclass(frozen=True)
class NotStartable:
    status: str
    """The job's status (an ended one), or 'missing'."""


@dataclass(frozen=True)
class Written:
    cancel: str | None
    """A cancel asked for since the worker started the job (its reason), or None."""


@dataclass(frozen=True)
class Fenced:
    """The writer no longer owns the job: nothing was written."""


@dataclass(frozen=True)
class LostTail:
    """The log ends at `last`, short of these events (Redis lost its tail): nothing written."""

    last: int


@dataclass(frozen=True)
class CancelRunning:
    worker: str
    attempt: int


@dataclass(frozen=True)
class CancelQueued:
    attempt: int
    last_seq: int


@dataclass(frozen=True)
class CancelEnded:
    status: str
    """The job's status (an ended one), or 'missing'."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket as a client is told of it: its size, what it holds, and the time until
    it is full again."""

    limit: int
    remaining: int
    reset_ms: int


@dataclass(frozen=True)
class Queued:
    """SUBMIT wrote the job."""

    tokens: Bucket | None = None
    """The owner's tokens-per-minute bucket after the job's charge (None: nothing charged)."""


@dataclass(frozen=True)
class ClaimedBefore:
    """The idempotency key was claimed already: what it holds."""

    claim: str


@dataclass(frozen=True)
class Limited:
    """Admitting the job would take a scope past a limit: nothing was written."""

    scope: int
    """Index into the admission's quotas."""
    what: str
    """'jobs' or 'tokens'."""
    count: int
    """What the scope holds now."""


@dataclass(frozen=True)
class Throttled:
    """The owner's tokens-per-minute bucket holds less than the job's charge: nothing was
    written."""

    retry_after_ms: int
    """Until it holds the charge."""
    tokens: Bucket


@dataclass(frozen=True)
class JobState:
    status: str
    """The job's status, or 'missing'."""
    attempt: int = 0
    last_seq: int = 0
    worker: str | None = None


StartReply = Started | Exhausted | Interrupted | NotStartable
EmitReply = Written | Fenced | LostTail
CancelReply = CancelRunning | CancelQueued | CancelEnded
SubmitReply = Queued | ClaimedBefore | Limited | Throttled


def _start_reply(r: list[Any]) -> StartReply:
    if r[0] == "ok":
        return Started(int(r[1]), int(r[2]), str(r[3]), r[4] or None)
    if r[0] == "exhausted":
        return Exhausted(int(r[1]), int(r[2]), str(r[3]), r[4] or None)
    if r[0] == "interrupted":
        return Interrupted(int(r[1]), int(r[2]), str(r[3]), int(r[4]))
    return NotStartable(str(r[0]))


def _emit_reply(r: list[Any]) -> EmitReply:
    code = int(r[0])
    if code == 1:
        return Written(r[1] or None)
    if code == 0:
        return Fenced()
    return LostTail(int(r[1]))


def _cancel_reply(r: list[Any]) -> CancelReply:
    if r[0] == "running":
        return CancelRunning(str(r[1]), int(r[2]))
    if r[0] == "queued":
        return CancelQueued(int(r[1]), int(r[2]))
    return CancelEnded(str(r[0]))


def _state_reply(r: list[Any]) -> JobState:
    if r[0] == "missing":
        return JobState("missing")
    return JobState(str(r[0]), int(r[1]), int(r[2]), r[3] or None)


def _abandoned(r: Any) -> SubmitReply:
    """SUBMIT_JOB's reply 0 (the chain goes on at 1): the reconciler gave this submit up."""
    raise Unavailable("the job could not be queued in time; submit it again")


def _submit_reply(tpm: int, r: list[Any]) -> SubmitReply:
    """`tpm`: the size of the tokens bucket the submit charged (if it did)."""
    if r[0] == "queued":
        return Queued(Bucket(tpm, int(r[1]), int(r[2])) if len(r) > 1 else None)
    if r[0] == "limited":
        return Limited(int(r[1]) - 1, str(r[2]), int(r[3]))
    if r[0] == "throttled":
        return Throttled(int(r[1]), Bucket(tpm, int(r[2]), int(r[3])))
    return ClaimedBefore(str(r[1]))


def lease(key: str, token: str, action: str, ttl_ms: int = 0) -> Call[bool]:
    """LEASE on `key` for `token`: take it or renew one's own for `ttl_ms` (`hold`), or free
    one's own (`free`); whether it was done (another holds it: False)."""
    args: dict[str, Arg] = {"token": token, "action": action, "ttl_ms": ttl_ms}
    return call(lua.LEASE, _truthy, {"lease": key}, args)


def _truthy(r: Any) -> bool:
    return bool(int(r))


def _flat(pairs: dict[str, str]) -> list[Arg]:
    return [x for kv in pairs.items() for x in kv]


def _events(events: Sequence[EncodedEvent]) -> list[Arg]:
    return [x for seq, data in events for x in (seq, data)]


# ---- the transitions ----------------------------------------------------------------------


class Transitions:
    """Builds the calls for the jobs of one key prefix. `recent_jobs`: the cap of the
    recent-jobs stream the submit and end of every job are noted in (GENQ_RECENT_JOBS);
    `compact_grace_s`: how long an ended job keeps its whole event log
    (GENQ_EVENT_COMPACT_GRACE_S)."""

    def __init__(
        self, keys: Keys, recent_jobs: int = RECENT_JOBS, compact_grace_s: int = COMPACT_GRACE_S
    ) -> None:
        self.keys = keys
        self.recent_jobs = recent_jobs
        self.compact_grace_s = compact_grace_s
        self.cluster = keys.cluster

    def _call(
        self,
        declared: ScriptArgs,
        parse: Callable[[Any], R],
        keys: Mapping[str, str],
        argv: Mapping[str, Arg] | None = None,
        rest: Sequence[Arg] = (),
        then: Callable[[Any], Call[R] | None] | None = None,
    ) -> Call[R]:
        return call(declared, parse, keys, argv, rest, cluster=self.cluster, then=then)

    def _compact_at(self) -> str:
        return repr(time.time() + self.compact_grace_s)

    def _job(self, job_id: str) -> dict[str, str]:
        """A job's keys by name (`shared.scripts.JOB`)."""
        k = self.keys
        return {"job": k.job(job_id), "events": k.events(job_id), "channel": k.channel(job_id)}

    def _ending(self, job_id: str) -> dict[str, str]:
        """A job's keys, and what its end touches (`shared.scripts.ENDING`): the admission
        counters, the deadlines index, the recent-jobs stream and the compaction index."""
        k = self.keys
        return {
            **self._job(job_id),
            "admission_counts": k.admission_counts(),
            "admission_jobs": k.admission_jobs(),
            "admission_checks": k.admission_checks(),
            "deadlines": k.deadlines(),
            "recent": k.recent_jobs(),
            "compact_due": k.compact_due(),
        }

    def submit(
        self,
        record: JobRecord,
        *,
        queued_event: str,
        entry: QueueEntry,
        idempotency_key: str | None,
        idempotency_claim: str,
        idempotency_ttl_s: int,
        admission: Admission,
        lane: str | None = None,
        news: str = "",
    ) -> Call[SubmitReply]:
        """`lane`: the worker lane placement chose (`Keys.placed`), None for the shared queue;
        `news`: what every gateway is told if the job waits there (`CacheNews`)."""
        spec = record.spec
        entry_fields = entry.to_hash()
        charge = admission.charge
        k = self.keys
        if self.cluster:
            return self._submit_steps(
                record,
                queued_event,
                entry_fields,
                idempotency_key,
                idempotency_claim,
                idempotency_ttl_s,
                admission,
                lane,
                news,
            )
        keys = {
            **self._job(spec.id),
            "queue": k.queue(spec.model, spec.priority),
            "deadlines": k.deadlines(),
            "idempotency": idempotency_key or "",
            "admission_counts": k.admission_counts(),
            "admission_jobs": k.admission_jobs(),
            "admission_checks": k.admission_checks(),
            "overflow": k.overflow(spec.model, spec.priority),
            "recent": k.recent_jobs(),
            "placed": lane or "",
            "placed_lanes": k.placed_lanes(),
            "fair_queue": k.fair_queue(spec.model, spec.priority),
            "fair_clock": k.fair_clock(spec.model, spec.priority),
            "tokens_bucket": charge.bucket if charge else "",
        }
        scopes: list[Arg] = []
        for q in admission.quotas:
            scopes += [q.jobs_field, q.tokens_field, q.max_jobs, q.max_tokens]
        args: dict[str, Arg] = {
            "job_id": spec.id,
            "claim": idempotency_claim,
            "claim_ttl": idempotency_ttl_s,
            "deadline": "" if spec.deadline is None else repr(spec.deadline),
            "queued_event": queued_event,
            "n_entry": len(entry_fields),
            "tokens": admission.tokens,
            "check_at": repr(admission.check_at),
            "n_scopes": len(admission.quotas),
            "fair_field": admission.fair_field,
            "fair_share": admission.fair_share,
            "fair_cost": "" if admission.fair_cost is None else repr(admission.fair_cost),
            "fair_owner": admission.fair_owner,
            "fair_window": admission.fair_window,
            "group": CONSUMER_GROUP,
            "recent_cap": self.recent_jobs,
            "model": spec.model,
            "priority": spec.priority,
            "charge": charge.tokens if charge else 0,
            "tpm": charge.tpm if charge else 0,
            "news": news if lane else "",
            "news_channel": k.cache_news(),
        }
        rest = [*scopes, *_flat(entry_fields), *_flat(record.to_hash())]
        reply = functools.partial(_submit_reply, charge.tpm if charge else 0)
        return self._call(lua.SUBMIT, reply, keys, args, rest)

    def _submit_steps(
        self,
        record: JobRecord,
        queued_event: str,
        entry_fields: dict[str, str],
        idempotency_key: str | None,
        claim: str,
        claim_ttl_s: int,
        admission: Admission,
        lane: str | None,
        news: str,
    ) -> Call[SubmitReply]:
        """SUBMIT on a cluster, as steps (module docstring): a look at the idempotency key,
        the tokens-per-minute charge, the admission (refused: the charge given back), the
        pending entry, the idempotency claim (another request's claim, made meanwhile, undoes
        the steps before), the record, the queue entry (in `lane`, a worker's lane of the
        job's shard, when placement chose one; then `news` to every gateway). A stop between
        the charge and a refusal's refund costs the owner that job's tokens until its bucket
        refills (a minute at most)."""
        spec, k = record.spec, self.keys
        shard = k.shard_of(spec.id)
        pending = {"pending": k.pending(shard), "pending_since": k.pending_since(shard)}
        charge = admission.charge
        left: list[Bucket] = []
        refund: list[Call[Any]] = []
        if charge:
            tpm: dict[str, Arg] = {"job_id": spec.id, "charge": charge.tokens, "tpm": charge.tpm}
            refund.append(self._call(lua.REFUND, int, {"bucket": charge.bucket}, tpm))

        told: list[bool] = []  # whether the entry went to `lane` (the news then follows)

        def queue_step(_raw: Any) -> Call[SubmitReply]:
            queued: SubmitReply = Queued(left[-1] if left else None)
            publish: Call[SubmitReply] | None = None
            if told and news:
                tell: dict[str, Arg] = {"news": news, "lane": ""}
                publish = self._call(
                    lua.PUBLISH_NEWS, lambda _r: queued, {"channel": k.cache_news()}, tell
                )
            return self._call(
                lua.SUBMIT_QUEUE,
                lambda _r: queued,
                self._queue_keys(shard),
                self._queue_args(spec.id),
                (),
                None if publish is None else lambda _r: publish,
            )

        def job_step(_raw: Any) -> Call[SubmitReply]:
            args: dict[str, Arg] = {"queued_event": queued_event}
            rest = _flat(record.to_hash())
            return self._call(
                lua.SUBMIT_JOB,
                _abandoned,
                self._job(spec.id),
                args,
                rest,
                lambda raw: queue_step(raw) if int(raw) == 1 else None,
            )

        def claimed(raw: Any) -> Call[SubmitReply] | None:
            if raw[0] != "exists":
                return job_step(raw)
            taken = _submit_reply(0, raw)  # another request's: undo this one's steps
            undo = [
                self._call(lua.PENDING_DROP, int, pending, {"job_id": spec.id}),
                self._release(spec.id),
                *refund,
            ]
            return steps(undo, taken)

        def claim_step(_raw: Any) -> Call[SubmitReply]:
            if idempotency_key is None:
                return job_step(None)
            args: dict[str, Arg] = {"claim": claim, "claim_ttl": claim_ttl_s}
            return self._call(
                lua.CLAIM_IDEMPOTENCY,
                functools.partial(_submit_reply, 0),
                {"idempotency": idempotency_key},
                args,
                (),
                claimed,
            )

        def intent_step(overflow: bool) -> Call[SubmitReply]:
            stream = (k.overflow if overflow else k.queue)(spec.model, spec.priority, shard)
            placed = lane is not None and not overflow
            if placed:
                assert lane is not None
                stream = lane
                told.append(True)
            deadline = "" if spec.deadline is None else repr(spec.deadline)
            pairs = "\x1f".join(str(x) for x in _flat(entry_fields))
            parts = [stream, deadline, spec.model, spec.priority, pairs, "1" if placed else ""]
            if admission.fair_cost is not None and not overflow and not placed:  # the shard's
                parts += [
                    k.fair_queue(spec.model, spec.priority, shard),
                    k.fair_clock(spec.model, spec.priority, shard),
                    repr(admission.fair_cost),
                    admission.fair_owner,
                    str(admission.fair_window),
                ]
            packed = "\x1e".join(parts)
            args: dict[str, Arg] = {"job_id": spec.id, "now": repr(time.time()), "entry": packed}
            return self._call(lua.SUBMIT_INTENT, lambda _r: Queued(), pending, args, (), claim_step)

        first = self._admit(spec.id, admission, intent_step, refund)
        if charge:
            admit = first

            def charged(raw: Any) -> Call[SubmitReply] | None:
                if raw[0] != "charged":
                    return None
                left.append(Bucket(charge.tpm, int(raw[1]), int(raw[2])))
                return admit

            args: dict[str, Arg] = {"job_id": spec.id, "charge": charge.tokens, "tpm": charge.tpm}
            first = self._call(
                lua.CHARGE,
                functools.partial(_submit_reply, charge.tpm),
                {"bucket": charge.bucket},
                args,
                (),
                charged,
            )
        if idempotency_key is None:
            return first
        return self._call(
            lua.PEEK_IDEMPOTENCY,
            functools.partial(_submit_reply, 0),
            {"idempotency": idempotency_key},
            {"claim": claim},
            (),
            lambda raw: None if raw[0] == "exists" else first,
        )

    def _admit(
        self,
        job_id: str,
        admission: Admission,
        then: Callable[[bool], Call[SubmitReply]],
        undo: Sequence[Call[Any]] = (),
    ) -> Call[SubmitReply]:
        """Cluster: ADMIT in the job's own stripe, and, refused there, in the next stripe
        that could hold it, and so on (shared/quotas.py); `then(overflow)` once one admits.
        Refused by every stripe: `undo` runs, and the refusal names the scope the own stripe
        found full, with what the stripes that refused for it hold together."""
        k = self.keys
        n = len(k.stripes)
        own = k.shard_of(job_id)
        order = [(own + j) % n for j in range(n)]
        tries = [(i, q) for i in order if (q := admission.stripe_quotas(i, n)) is not None]
        # none could ever hold it (the gateway refuses such a job first): stripe 0's shares,
        # the largest, refuse it
        tries = tries or [(0, tuple(q.at(0, n) for q in admission.quotas))]
        refused: dict[int, list[Any]] = {}

        def refusal(_raw: Any) -> SubmitReply:
            first = next(iter(refused.values()))
            same = [r for r in refused.values() if r[1:3] == first[1:3]]
            return Limited(int(first[1]) - 1, str(first[2]), sum(int(r[3]) for r in same))

        def at(t: int) -> Call[SubmitReply]:
            stripe, quotas = tries[t]
            scopes: list[Arg] = []
            for q in quotas:
                scopes += [q.jobs_field, q.tokens_field, q.max_jobs, q.max_tokens]
            args: dict[str, Arg] = {
                "job_key": k.job(job_id),
                "tokens": admission.tokens,
                "check_at": repr(admission.check_at),
                "n_scopes": len(quotas),
                "fair_field": admission.fair_field,
                "fair_share": admission.fair_share_of(n),
            }

            def after(raw: Any) -> Call[SubmitReply] | None:
                if raw[0] != "limited":
                    return then(int(raw[1]) == 1)
                refused[stripe] = list(raw)
                if t + 1 < len(tries):
                    return at(t + 1)
                return steps(undo, refusal(None))

            return self._call(lua.ADMIT, refusal, self._admission_keys(stripe), args, scopes, after)

        return at(0)

    def _release(self, job_id: str) -> Call[int]:
        """Cluster: ADMISSION_RELEASE of a job in its own stripe, then, not counted there,
        in the others (where a refusal sent its admission)."""
        k = self.keys
        n = len(k.stripes)
        own = k.shard_of(job_id)
        order = [(own + j) % n for j in range(n)]

        def at(t: int) -> Call[int]:
            def after(raw: Any) -> Call[int] | None:
                return at(t + 1) if int(raw) == 0 and t + 1 < n else None

            keys = self._admission_keys(order[t])
            return self._call(
                lua.ADMISSION_RELEASE, int, keys, {"job_key": k.job(job_id)}, (), after
            )

        return at(0)

    def _admission_keys(self, stripe: int = 0) -> dict[str, str]:
        k = self.keys
        return {
            "counts": k.admission_counts(stripe),
            "jobs": k.admission_jobs(stripe),
            "checks": k.admission_checks(stripe),
        }

    def abandon(self, job_id: str, ttl_s: int) -> Call[bool]:
        """Cluster, the reconciler: a pending submit whose record never came is given up
        (ABANDON_JOB, then its pending entry dropped and its admission count given back);
        False: its record is there after all."""
        k, shard = self.keys, self.keys.shard_of(job_id)
        pending = {"pending": k.pending(shard), "pending_since": k.pending_since(shard)}
        undo = [
            self._call(lua.PENDING_DROP, int, pending, {"job_id": job_id}),
            self._release(job_id),
        ]
        return self._call(
            lua.ABANDON_JOB,
            _truthy,
            {"job": k.job(job_id)},
            {"ttl": ttl_s},
            (),
            lambda raw: steps(undo, True) if int(raw) == 1 else None,
        )

    def reconcile(self, job_id: str) -> Call[bool]:
        """Cluster: queue a job whose submit stopped after writing its record (SUBMIT_QUEUE:
        nothing if it is queued already); whether this queued it."""
        shard = self.keys.shard_of(job_id)
        return self._call(
            lua.SUBMIT_QUEUE, _truthy, self._queue_keys(shard), self._queue_args(job_id)
        )

    def _queue_keys(self, shard: int) -> dict[str, str]:
        """SUBMIT_QUEUE's keys: a queue shard's."""
        k = self.keys
        return {
            "pending": k.pending(shard),
            "pending_since": k.pending_since(shard),
            "deadlines": k.deadlines(shard),
            "recent": k.recent_jobs(shard),
            "placed_lanes": k.placed_lanes(shard),
        }

    def _queue_args(self, job_id: str) -> dict[str, Arg]:
        return {"job_id": job_id, "recent_cap": self.recent_jobs, "group": CONSUMER_GROUP}

    def _end_steps(
        self, job_id: str, raw_end: Sequence[Any], entry: tuple[str, str] | None
    ) -> list[Call[Any]]:
        """Cluster: what a job's end does beyond its own slot, from what its end step read
        of the record: (status, done stream, outbox). The streams are told first, and the
        record marked told (TOLD) where an outbox heard: until the queue entry is
        acknowledged (JOB_ENDED) a stop in between leaves the entry to be reclaimed, and the
        START that finds the job ended tells again what was not marked (`start`); then the
        indexes and the entry's ack, then the admission count."""
        k, shard = self.keys, self.keys.shard_of(job_id)
        status, done_stream, outbox = (str(x) for x in raw_end)
        queue, entry_id = entry or (k.deadlines(shard), "")
        ended: dict[str, Arg] = {
            "job_id": job_id,
            "compact": "0" if done_stream else "1",
            "compact_at": self._compact_at(),
            "recent_cap": self.recent_jobs,
            "status": status,
            "group": CONSUMER_GROUP,
            "entry": entry_id,
        }
        index_keys = {
            "deadlines": k.deadlines(shard),
            "compact_due": k.compact_due(shard),
            "recent": k.recent_jobs(shard),
            "queue": queue,
        }
        told: dict[str, Arg] = {"job_id": job_id}
        out: list[Call[Any]] = [
            self._call(lua.TELL_STREAM, int, {"stream": stream}, told)
            for stream in (done_stream, outbox)
            if stream
        ]
        if outbox:
            out.append(self._call(lua.TOLD, int, {"job": k.job(job_id)}))
        out += [self._call(lua.JOB_ENDED, int, index_keys, ended), self._release(job_id)]
        return out

    def start(
        self, job_id: str, *, worker: str, now: float, max_attempts: int, max_interruptions: int
    ) -> Call[StartReply]:
        args: dict[str, Arg] = {
            "worker": worker,
            "now": repr(now),
            "max_attempts": max_attempts,
            "max_interruptions": max_interruptions,
        }
        then = None
        if self.cluster:

            def then(raw: Any) -> Call[StartReply] | None:
                # ended with an outbox that never heard (its ender stopped between the
                # steps): the end's steps again, from the first
                if len(raw) == 4 and raw[2] and raw[3] != "1":
                    return steps(self._end_steps(job_id, raw[:3], None), _start_reply(raw))
                return None

        return self._call(lua.START, _start_reply, self._job(job_id), args, (), then)

    def emit(
        self,
        job_id: str,
        *,
        worker: str,
        attempt: int,
        events: Sequence[EncodedEvent],
        maxlen: int,
        fields: dict[str, str] | None = None,
        retention_s: int = 0,
        entry: tuple[str, str] | None = None,
    ) -> Call[EmitReply]:
        """The owner's events, and (when the job ends) its record `fields` and retention;
        with `entry` (queue, entry id), the end acknowledges and deletes that queue entry."""
        if self.cluster:
            return self._emit_steps(
                job_id, worker, attempt, events, maxlen, fields, retention_s, entry
            )
        queue, entry_id = entry or ("", "")
        args: dict[str, Arg] = {
            "worker": worker,
            "attempt": attempt,
            "maxlen": maxlen,
            "retention": retention_s,
            "job_id": job_id,
            "recent_cap": self.recent_jobs,
            "compact_at": self._compact_at(),
            "group": CONSUMER_GROUP,
            "entry": entry_id,
            "n": len(events),
        }
        rest = [*_events(events), *_flat(fields or {})]
        keys = {**self._ending(job_id), "queue": queue}
        return self._call(lua.EMIT, _emit_reply, keys, args, rest)

    def _emit_steps(
        self,
        job_id: str,
        worker: str,
        attempt: int,
        events: Sequence[EncodedEvent],
        maxlen: int,
        fields: dict[str, str] | None,
        retention_s: int,
        entry: tuple[str, str] | None,
    ) -> Call[EmitReply]:
        """EMIT on a cluster: the job's own slot first, then (at its end) `_end_steps`."""
        args: dict[str, Arg] = {
            "worker": worker,
            "attempt": attempt,
            "maxlen": maxlen,
            "retention": retention_s,
            "n": len(events),
        }
        rest = [*_events(events), *_flat(fields or {})]

        def then(raw: Any) -> Call[EmitReply] | None:
            if int(raw[0]) != 1 or retention_s <= 0:
                return None
            return steps(self._end_steps(job_id, raw[2:5], entry), _emit_reply(raw))

        return self._call(lua.EMIT_JOB, _emit_reply, self._job(job_id), args, rest, then)

    def settle(
        self,
        job_id: str,
        *,
        status: str,
        attempt: int,
        last_seq: int,
        event: EncodedEvent,
        fields: dict[str, str],
        maxlen: int,
        retention_s: int,
    ) -> Call[bool]:
        """End a job nobody runs, if its status, attempt and log end are still these."""
        if self.cluster:
            cas: dict[str, Arg] = {
                "status": status,
                "attempt": attempt,
                "last_seq": last_seq,
                "maxlen": maxlen,
                "retention": retention_s,
            }

            def then(raw: Any) -> Call[bool] | None:
                if int(raw[0]) != 1:
                    return None
                return steps(self._end_steps(job_id, raw[1:4], None), True)

            rest = [*event, *_flat(fields)]
            return self._call(
                lua.SETTLE_JOB, lambda r: int(r[0]) == 1, self._job(job_id), cas, rest, then
            )
        args: dict[str, Arg] = {
            "status": status,
            "attempt": attempt,
            "last_seq": last_seq,
            "maxlen": maxlen,
            "retention": retention_s,
            "job_id": job_id,
            "recent_cap": self.recent_jobs,
            "compact_at": self._compact_at(),
        }
        return self._call(lua.SETTLE, _truthy, self._ending(job_id), args, [*event, *_flat(fields)])

    def compact(
        self, job_id: str, *, last_seq: int, entries: int, fields: dict[str, str]
    ) -> Call[str]:
        """Replace an ended job's event log by its compact form, set with the other record
        `fields` (the `log` field among them), if the log still ends at `last_seq` with
        `entries`."""
        k = self.keys
        if self.cluster:
            index = k.compact_due(k.shard_of(job_id))

            def then(raw: Any) -> Call[str] | None:
                if raw == "changed":
                    return None
                remove: dict[str, Arg] = {"job_id": job_id}
                return self._call(lua.INDEX_REMOVE, lambda _r: str(raw), {"index": index}, remove)

            job_keys = {"job": k.job(job_id), "events": k.events(job_id)}
            cas: dict[str, Arg] = {"last_seq": last_seq, "entries": entries}
            return self._call(lua.COMPACT_JOB, str, job_keys, cas, _flat(fields), then)
        keys = {"job": k.job(job_id), "events": k.events(job_id), "compact_due": k.compact_due()}
        args: dict[str, Arg] = {"job_id": job_id, "last_seq": last_seq, "entries": entries}
        return self._call(lua.COMPACT, str, keys, args, _flat(fields))

    def hand_back(
        self,
        job_id: str,
        *,
        worker: str,
        attempt: int,
        counted: bool,
        interrupted: bool = False,
        error: str = "",
    ) -> Call[bool]:
        """Give a job back to the queue. `counted`: a failed attempt; `interrupted`: a stop
        of its worker ended the attempt (START fails a job interrupted too often)."""
        args: dict[str, Arg] = {
            "worker": worker,
            "attempt": attempt,
            "counted": int(counted),
            "interrupted": int(interrupted),
            "error": error,
        }
        return self._call(lua.HAND_BACK, _truthy, self._job(job_id), args)

    def request_cancel(self, job_id: str, *, reason: str) -> Call[CancelReply]:
        return self._call(lua.REQUEST_CANCEL, _cancel_reply, self._job(job_id), {"reason": reason})

    def touch(
        self,
        queue: str,
        entry_id: str,
        job_id: str,
        *,
        group: str,
        worker: str,
        attempt: int | None,
    ) -> Call[bool]:
        """Keep a held entry's idle time low, if this worker still holds it (`attempt`: the
        job's, once started; None for a claim not started yet)."""
        if self.cluster:
            held: dict[str, Arg] = {"group": group, "worker": worker, "entry": entry_id}
            touch = self._call(lua.TOUCH_QUEUE, _truthy, {"queue": queue}, held)
            if attempt is None:
                return touch
            owner: dict[str, Arg] = {"worker": worker, "attempt": attempt}
            return self._call(
                lua.OWNS_JOB,
                _truthy,
                {"job": self.keys.job(job_id)},
                owner,
                (),
                lambda raw: touch if int(raw) == 1 else None,
            )
        keys = {"queue": queue, "job": self.keys.job(job_id)}
        args: dict[str, Arg] = {
            "group": group,
            "worker": worker,
            "entry": entry_id,
            "attempt": "" if attempt is None else attempt,
        }
        return self._call(lua.TOUCH, _truthy, keys, args)

    def state(self, job_id: str) -> Call[JobState]:
        return self._call(lua.STATE, _state_reply, self._job(job_id))

    def release_idempotency(self, key: str, *, claim: str) -> Call[bool]:
        return self._call(lua.RELEASE_IDEMPOTENCY, _truthy, {"idempotency": key}, {"claim": claim})

    def steal(
        self,
        lane: str,
        queue: str,
        *,
        group: str,
        older_ms: int,
        dead: bool,
        limit: int,
        shard: int = 0,
    ) -> Call[tuple[int, int]]:
        """Move a worker lane's waiting entries older than `older_ms` (all: `dead`) to
        `queue` (both of queue shard `shard`); (moved, still waiting)."""
        placed_lanes = self.keys.placed_lanes(shard)
        keys = {"lane": lane, "queue": queue, "placed_lanes": placed_lanes}
        args: dict[str, Arg] = {
            "group": group,
            "older_ms": older_ms,
            "dead": "1" if dead else "0",
            "limit": limit,
        }
        return self._call(lua.STEAL, lambda r: (int(r[0]), int(r[1])), keys, args)

    def cache_news(
        self,
        lanes: Sequence[tuple[str, str]],
        news: str,
        held: int,
        waiting: int = 0,
        counted: Callable[[int], None] | None = None,
    ) -> Call[int]:
        """Publish a worker's cache news (`CacheNews`, encoded) with the jobs waiting in its
        `lanes` (its own, (interactive, batch) of each queue shard) counted, less the `held`
        entries of them it holds; how many listeners it reached. On a cluster the lanes are
        in the shards' slots, not the channel's: the news goes out at once on its shard
        channel (PUBLISH_NEWS) with `waiting`, the entries its lanes held when last counted,
        then each shard's are counted in a step of their own (LANE_COUNT) and their sum
        handed to `counted`, for the next news."""
        if not self.cluster:
            [(interactive, batch)] = lanes
            keys = {"interactive": interactive, "batch": batch}
            args: dict[str, Arg] = {"channel": self.keys.cache_news(), "news": news, "held": held}
            return self._call(lua.CACHE_NEWS, int, keys, args)
        counts: list[int] = []

        def count(t: int) -> Call[int]:
            def after(raw: Any) -> Call[int] | None:
                counts.append(int(raw))
                if t + 1 < len(lanes):
                    return count(t + 1)
                if counted is not None:
                    counted(sum(counts))
                return None

            interactive, batch = lanes[t]
            keys = {"interactive": interactive, "batch": batch}
            return self._call(lua.LANE_COUNT, int, keys, {}, (), after)

        tell: dict[str, Arg] = {"news": news, "lane": max(0, waiting - held)}
        channel = {"channel": self.keys.cache_news()}
        return self._call(lua.PUBLISH_NEWS, int, channel, tell, (), lambda _r: count(0))

    def release(
        self,
        model: str,
        priority: Priority,
        want: int,
        skip: Iterable[str] = (),
        lane: str | None = None,
        shard: int = 0,
    ) -> Call[int]:
        """Let token-fair scheduling's next jobs into the queue of `model`'s `priority` (of
        queue shard `shard`) until it holds `want` not yet delivered; how many it let in.
        With owners to `skip`, their jobs stay queued and other owners' go to `lane` instead
        (a worker's own, which it reads first): those in the queue not yet delivered, then
        the next in turn."""
        k = self.keys
        skipped = ",".join(skip)
        if skipped and lane is None:
            raise ValueError("jobs released past skipped owners go to a worker's own lane")
        shared = k.queue(model, priority, shard)
        keys = {
            "queue": lane if skipped and lane is not None else shared,
            "fair_queue": k.fair_queue(model, priority, shard),
            "fair_clock": k.fair_clock(model, priority, shard),
            "placed_lanes": k.placed_lanes(shard),
            "shared": shared,
        }
        args: dict[str, Arg] = {"group": CONSUMER_GROUP, "want": want, "skip": skipped}
        return self._call(lua.RELEASE, int, keys, args)

    def delete_idle_consumer(self, queue: str, *, group: str, consumer: str) -> Call[bool]:
        args: dict[str, Arg] = {"group": group, "consumer": consumer}
        return self._call(lua.DELETE_IDLE_CONSUMER, _truthy, {"queue": queue}, args)


class ScriptRunner:
    """Runs calls on one Redis client by EVALSHA, reloading scripts Redis has forgotten."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def run(self, call: Call[R]) -> R:
        """One call (and the steps it leads to, on a cluster); Redis errors raise."""
        while True:
            try:
                raw = await self._evalsha(self.redis, call)
            except NoScriptError:
                await self.load([call.script])
                raw = await self._evalsha(self.redis, call)
            following = call.next(raw)
            if following is None:
                return call.parse(raw)
            call = following

    async def run_replicated(self, call: Call[R], replicas: int, timeout_ms: int) -> tuple[R, int]:
        """One call, then WAIT for `replicas` replicas to hold it (at most `timeout_ms`):
        its parsed reply and how many did. Both go in one pipeline, so on one connection:
        WAIT counts the replicas that have this connection's last write."""
        if replicas <= 0:
            return await self.run(call), 0
        raw, acked = await self._replicated(call, replicas, timeout_ms)
        if isinstance(raw, NoScriptError):
            await self.load([call.script])
            raw, acked = await self._replicated(call, replicas, timeout_ms)
        for r in (raw, acked):
            if isinstance(r, Exception):
                raise r
        return call.parse(raw), int(acked)

    async def _replicated(self, call: Call[Any], replicas: int, timeout_ms: int) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        pipe.execute_command("WAIT", replicas, timeout_ms)
        return list(await pipe.execute(raise_on_error=False))

    async def run_all(self, calls: Sequence[Call[Any]]) -> list[Any]:
        """One pipeline; each call's parsed reply, or the error Redis answered it with, in
        place (one refused call does not fail the others). Connection errors raise."""
        out: list[Any] = [None] * len(calls)
        todo = list(enumerate(calls))
        while todo:  # one round on one Redis; on a cluster, one per step
            following: list[tuple[int, Call[Any]]] = []
            for (i, c), r in zip(todo, await self._round([c for _, c in todo]), strict=True):
                step = None if isinstance(r, Exception) else c.next(r)
                if step is not None:
                    following.append((i, step))
                else:
                    out[i] = r if isinstance(r, Exception) else c.parse(r)
            todo = following
        return out

    async def _round(self, calls: Sequence[Call[Any]]) -> list[Any]:
        """One pipeline of `calls`, those answered NOSCRIPT sent again once loaded."""
        raw = await self._pipeline(calls)
        again = [i for i, r in enumerate(raw) if isinstance(r, NoScriptError)]
        if again:
            await self.load([calls[i].script for i in again])
            for i, r in zip(again, await self._pipeline([calls[i] for i in again]), strict=True):
                raw[i] = r
        return raw

    async def load(self, scripts: Sequence[Script]) -> None:
        for s in {s.name: s for s in scripts}.values():
            await self.redis.script_load(s.source)

    async def _pipeline(self, calls: Sequence[Call[Any]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for c in calls:
            pipe.evalsha(c.script.sha, len(c.keys), *c.keys, *c.args)
        return list(await pipe.execute(raise_on_error=False))

    @staticmethod
    async def _evalsha(client: Any, call: Call[R]) -> Any:
        return await client.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
