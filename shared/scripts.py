"""Each Lua script's KEYS and ARGV, declared once by name.

The Python call is built from the declaration (`ScriptArgs.pack`: the names in, the lists in
declared order out, a missing or unknown name refused), and the Lua side reads the same names:
when a script is loaded (`shared.transitions.script`) the prologue generated here is put before
it, unpacking KEYS into the table `K` and ARGV into `A` (`K.job`, `A.worker`), with `REST` the
first ARGV index of a variadic tail (pairs, groups) and a check that the call brought as many
as declared. A script names its arguments only through them (tests/unit/test_script_args.py
holds every script to its declaration), so adding an argument is one edit here and its uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Arg = str | int | float


@dataclass(frozen=True)
class ScriptArgs:
    name: str
    """The script: `shared/lua/<name>.lua`."""
    keys: tuple[str, ...]
    argv: tuple[str, ...] = ()
    rest: str = ""
    """What ARGV holds after the named ones, from index `REST` ('' : nothing)."""

    def __post_init__(self) -> None:
        for names in (self.keys, self.argv):
            if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
                raise ValueError(f"{self.name}: names must be distinct identifiers: {names}")

    def pack(
        self,
        keys: Mapping[str, str],
        argv: Mapping[str, Arg] | None = None,
        rest: Sequence[Arg] = (),
    ) -> tuple[list[str], list[Arg]]:
        """KEYS and ARGV in declared order, from every declared name (ValueError naming any
        that is missing or not declared); `rest` after them."""
        argv = argv or {}
        try:
            key_list = [keys[n] for n in self.keys]
            args = [argv[n] for n in self.argv]
        except KeyError:
            raise ValueError(self._mismatch(keys, argv)) from None
        if len(keys) != len(self.keys) or len(argv) != len(self.argv):
            raise ValueError(self._mismatch(keys, argv))
        if rest:
            if not self.rest:
                raise ValueError(f"{self.name} takes no ARGV after {', '.join(self.argv)}")
            args += rest
        return key_list, args

    def _mismatch(self, keys: Mapping[str, str], argv: Mapping[str, Arg]) -> str:
        wrong = []
        for what, given, declared in (("KEYS", keys, self.keys), ("ARGV", argv, self.argv)):
            missing = [n for n in declared if n not in given]
            unknown = sorted(set(given) - set(declared))
            if missing:
                wrong.append(f"{what} {', '.join(missing)} missing")
            if unknown:
                wrong.append(f"{what} {', '.join(unknown)} not declared")
        return f"{self.name}: {'; '.join(wrong)}"

    def prologue(self) -> str:
        """Lua that unpacks KEYS and ARGV by name, after checking their counts."""
        n_keys, n_args = len(self.keys), len(self.argv)
        args_ok = f"#ARGV < {n_args}" if self.rest else f"#ARGV ~= {n_args}"
        want = f"{'at least ' if self.rest else ''}{n_args}"
        lines = [
            f"-- {self.name}: KEYS and ARGV by name (generated from shared/scripts.py)",
            f"if #KEYS ~= {n_keys} or {args_ok} then",
            f"  return redis.error_reply('{self.name}: {n_keys} KEYS and {want} ARGV expected, "
            "got ' .. #KEYS .. ' and ' .. #ARGV)",
            "end",
            "local K = {" + ", ".join(f"{n} = KEYS[{i}]" for i, n in enumerate(self.keys, 1)) + "}",
            "local A = {" + ", ".join(f"{n} = ARGV[{i}]" for i, n in enumerate(self.argv, 1)) + "}",
        ]
        if self.rest:
            lines.append(f"local REST = {n_args + 1}  -- ARGV from here on: {self.rest}")
        return "\n".join(lines) + "\n"


JOB = ("job", "events", "channel")
"""A job's keys: its record (hash), its event log (stream, entry ids 0-<seq>), its channel."""
ENDING = (
    *JOB,
    "admission_counts",
    "admission_jobs",
    "admission_checks",
    "deadlines",
    "recent",
    "compact_due",
)
"""A job's keys, and what its end touches: the admission counters (see release in
prelude.lua), the deadlines index, the recent-jobs stream and the compaction index."""

SUBMIT = ScriptArgs(
    "submit",
    keys=(
        "job",
        "events",
        "channel",
        "queue",
        "deadlines",
        "idempotency",
        "admission_counts",
        "admission_jobs",
        "admission_checks",
        "overflow",
        "recent",
        "placed",
        "placed_lanes",
        "fair_queue",
        "fair_clock",
        "tokens_bucket",
    ),
    argv=(
        "job_id",
        "claim",
        "claim_ttl",
        "deadline",
        "queued_event",
        "n_entry",
        "tokens",
        "check_at",
        "n_scopes",
        "fair_field",
        "fair_share",
        "recent_cap",
        "model",
        "priority",
        "fair_cost",
        "fair_owner",
        "fair_window",
        "group",
        "charge",
        "tpm",
        "news",
        "news_channel",
    ),
    rest="n_scopes scopes (jobs field, tokens field, max jobs, max tokens), then n_entry "
    "queue entry (field, value) pairs, then record (field, value) pairs",
)
EMIT = ScriptArgs(
    "emit",
    keys=(*ENDING, "queue"),
    argv=(
        "worker",
        "attempt",
        "maxlen",
        "retention",
        "job_id",
        "recent_cap",
        "compact_at",
        "group",
        "entry",
        "n",
    ),
    rest="n (seq, json) pairs, then record (field, value) pairs",
)
SETTLE = ScriptArgs(
    "settle",
    keys=ENDING,
    argv=(
        "status",
        "attempt",
        "last_seq",
        "maxlen",
        "retention",
        "job_id",
        "recent_cap",
        "compact_at",
    ),
    rest="one (seq, json) pair, then record (field, value) pairs",
)
COMPACT = ScriptArgs(
    "compact",
    keys=("job", "events", "compact_due"),
    argv=("job_id", "last_seq", "entries"),
    rest="record (field, value) pairs: the compact log (`log`), and fields packed smaller",
)
START = ScriptArgs("start", keys=JOB, argv=("worker", "now", "max_attempts", "max_interruptions"))
HAND_BACK = ScriptArgs(
    "hand_back", keys=JOB, argv=("worker", "attempt", "counted", "interrupted", "error")
)
REQUEST_CANCEL = ScriptArgs("request_cancel", keys=JOB, argv=("reason",))
TOUCH = ScriptArgs("touch", keys=("queue", "job"), argv=("group", "worker", "entry", "attempt"))
STATE = ScriptArgs("state", keys=JOB)
RELEASE_IDEMPOTENCY = ScriptArgs("release_idempotency", keys=("idempotency",), argv=("claim",))
DELETE_IDLE_CONSUMER = ScriptArgs(
    "delete_idle_consumer", keys=("queue",), argv=("group", "consumer")
)
RATE_LIMIT = ScriptArgs("rate_limit", keys=("requests", "tokens"), argv=("rate", "burst", "tpm"))
ADMISSION_DUE = ScriptArgs("admission_due", keys=("checks",), argv=("now", "next_at", "limit"))
ADMISSION_RELEASE = ScriptArgs(
    "admission_release", keys=("counts", "jobs", "checks"), argv=("job_key",)
)
BATCH_RESULTS = ScriptArgs(
    "batch_results",
    keys=("batch", "output", "errors"),
    argv=("ttl", "n"),
    rest="n groups of (line, 'out' | 'err', json, input tokens, output tokens, cached tokens)",
)
BATCH_UPDATE = ScriptArgs(
    "batch_update",
    keys=("batch", "lease", "outbox"),
    argv=("token", "statuses", "notify", "batch_id"),
    rest="record (field, value) pairs",
)
LEASE = ScriptArgs("lease", keys=("lease",), argv=("token", "action", "ttl_ms"))
RELEASE = ScriptArgs(
    "release",
    keys=("queue", "fair_queue", "fair_clock", "placed_lanes", "shared"),
    argv=("group", "want", "skip"),
)
STEAL = ScriptArgs(
    "steal", keys=("lane", "queue", "placed_lanes"), argv=("group", "older_ms", "dead", "limit")
)
CACHE_NEWS = ScriptArgs(
    "cache_news", keys=("interactive", "batch"), argv=("channel", "news", "held")
)

# ---- Redis Cluster: the steps a script spanning slots runs as (shared/transitions.py) ----

PEEK_IDEMPOTENCY = ScriptArgs("peek_idempotency", keys=("idempotency",), argv=("claim",))
CLAIM_IDEMPOTENCY = ScriptArgs(
    "claim_idempotency", keys=("idempotency",), argv=("claim", "claim_ttl")
)
ADMIT = ScriptArgs(
    "admit",
    keys=("counts", "jobs", "checks"),
    argv=("job_key", "tokens", "check_at", "n_scopes", "fair_field", "fair_share"),
    rest="n_scopes scopes (jobs field, tokens field, max jobs, max tokens)",
)
CHARGE = ScriptArgs("charge", keys=("bucket",), argv=("job_id", "charge", "tpm"))
REFUND = ScriptArgs("refund", keys=("bucket",), argv=("job_id", "charge", "tpm"))
SUBMIT_INTENT = ScriptArgs(
    "submit_intent", keys=("pending", "pending_since"), argv=("job_id", "now", "entry")
)
SUBMIT_JOB = ScriptArgs("submit_job", keys=JOB, argv=("queued_event",), rest="record pairs")
SUBMIT_QUEUE = ScriptArgs(
    "submit_queue",
    keys=("pending", "pending_since", "deadlines", "recent", "placed_lanes"),
    argv=("job_id", "recent_cap", "group"),
)
EMIT_JOB = ScriptArgs(
    "emit_job",
    keys=JOB,
    argv=("worker", "attempt", "maxlen", "retention", "n"),
    rest="n (seq, json) pairs, then record (field, value) pairs",
)
SETTLE_JOB = ScriptArgs(
    "settle_job",
    keys=JOB,
    argv=("status", "attempt", "last_seq", "maxlen", "retention"),
    rest="one (seq, json) pair, then record (field, value) pairs",
)
JOB_ENDED = ScriptArgs(
    "job_ended",
    keys=("deadlines", "compact_due", "recent", "queue"),
    argv=("job_id", "compact", "compact_at", "recent_cap", "status", "group", "entry"),
)
TELL_STREAM = ScriptArgs("tell_stream", keys=("stream",), argv=("job_id",))
TOLD = ScriptArgs("told", keys=("job",))
LANE_COUNT = ScriptArgs("lane_count", keys=("interactive", "batch"))
PUBLISH_NEWS = ScriptArgs("publish_news", keys=("channel",), argv=("news", "lane"))
TELL_BATCH = ScriptArgs("tell_batch", keys=("outbox",), argv=("batch_id", "status"))
COMPACT_JOB = ScriptArgs(
    "compact_job",
    keys=("job", "events"),
    argv=("last_seq", "entries"),
    rest="record (field, value) pairs, as COMPACT",
)
INDEX_REMOVE = ScriptArgs("index_remove", keys=("index",), argv=("job_id",))
ABANDON_JOB = ScriptArgs("abandon_job", keys=("job",), argv=("ttl",))
PENDING_DROP = ScriptArgs("pending_drop", keys=("pending", "pending_since"), argv=("job_id",))
OWNS_JOB = ScriptArgs("owns_job", keys=("job",), argv=("worker", "attempt"))
TOUCH_QUEUE = ScriptArgs("touch_queue", keys=("queue",), argv=("group", "worker", "entry"))

DECLARED: dict[str, ScriptArgs] = {
    s.name: s
    for s in (
        SUBMIT,
        EMIT,
        SETTLE,
        COMPACT,
        START,
        HAND_BACK,
        REQUEST_CANCEL,
        TOUCH,
        STATE,
        RELEASE_IDEMPOTENCY,
        DELETE_IDLE_CONSUMER,
        RATE_LIMIT,
        ADMISSION_DUE,
        ADMISSION_RELEASE,
        BATCH_RESULTS,
        BATCH_UPDATE,
        LEASE,
        STEAL,
        RELEASE,
        CACHE_NEWS,
        PEEK_IDEMPOTENCY,
        CLAIM_IDEMPOTENCY,
        ADMIT,
        CHARGE,
        REFUND,
        SUBMIT_INTENT,
        SUBMIT_JOB,
        SUBMIT_QUEUE,
        EMIT_JOB,
        SETTLE_JOB,
        JOB_ENDED,
        TELL_STREAM,
        TOLD,
        LANE_COUNT,
        PUBLISH_NEWS,
        TELL_BATCH,
        COMPACT_JOB,
        INDEX_REMOVE,
        ABANDON_JOB,
        PENDING_DROP,
        OWNS_JOB,
        TOUCH_QUEUE,
    )
}
"""Every script's declaration, by name."""
