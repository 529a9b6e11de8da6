"""Every Redis key genq uses is built here, and only here.

Keys of one job carry the job id as a Cluster hash tag (`{id}`) so they share a slot; so do
the keys of one file (`{file-…}`) and of one batch (`{batch_…}`); on one Redis the admission
keys (counters of admitted jobs, see shared/quotas.py) share the tag `{admission}`.

The slot plan on a Redis Cluster (`Keys(cluster=True)`; on a single Redis every key below is
built exactly as before, untagged):

- a job's slot `{<job id>}`: its record, event log, live channel (a shard channel: SPUBLISH),
  Responses record, `resumed` mark. Every script of one job's life (START, EMIT's writes,
  HAND_BACK, REQUEST_CANCEL, STATE, SETTLE's writes, COMPACT's writes) touches only these.
- a queue shard's slot `{<shard tag>}` (`shard_tag`; GENQ_QUEUE_SHARDS of them, their tags
  chosen so their slots fall in evenly spaced ranges, i.e. on different primaries of a cluster
  made with equal ranges): every model's queues, overflows, token-fair sets and worker lanes
  of that shard, and the shard's own indexes of its jobs: deadlines, compaction due,
  recent jobs, placed lanes, and `pending` (submits recorded but maybe not queued yet, which
  the reconciler finishes). A job belongs to shard `shard_of(id)` (a hash of its id), so any
  process finds a job's indexes from its id alone. Each shard's slot also holds one stripe
  of the admission counters (its share of every limit: shared/quotas.py), so admission
  spreads over the primaries as the queues do.
- a file's slot, a batch's slot: as on one Redis.
- an owner's slot `{o:<owner>}`: its request and tokens-per-minute buckets (RATE_LIMIT reads
  both; CHARGE and REFUND are SUBMIT's tokens step).
- `{webhooks}`: the webhook outbox, delivery records, due set, dead letters, disabled
  endpoints and the sender's lease (gateway/webhooks.py acks and records in one MULTI).
- everything else (workers, model cards, gateways, locks and leases, idempotency keys,
  listings) is one key in a slot of its own, only ever touched alone.

A script that would span slots on a cluster runs as steps instead, one slot each, ordered so
that a crash between two leaves nothing a reader could mistake (shared/transitions.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch")
CONSUMER_GROUP = "workers"


@cache
def shard_tags(shards: int) -> tuple[str, ...]:
    """A hash tag per queue shard whose slot lies in the shard's own 1/`shards` of the slot
    range: a cluster made with equal ranges per primary (redis-cli --cluster create) then
    holds the shards evenly, whatever their number's CRC16 would have done."""
    tags: list[str] = []
    width = REDIS_CLUSTER_HASH_SLOTS / shards
    for i in range(shards):
        n = 0
        while int(key_slot(f"q{i}.{n}".encode()) // width) != i:
            n += 1
        tags.append(f"q{i}.{n}")
    return tuple(tags)


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "genq:"
    cluster: bool = False
    """Build the Cluster slot plan (module docstring): queue keys and the jobs' indexes under
    their shard's tag. False: one Redis, every key as it always was."""
    shards: int = 1
    """Queue shards (GENQ_QUEUE_SHARDS); more than 1 only with `cluster`."""
    _tags: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.shards < 1 or (self.shards > 1 and not self.cluster):
            raise ValueError("queue shards above 1 need a Redis Cluster")
        object.__setattr__(self, "_tags", shard_tags(self.shards) if self.cluster else ())

    def shard_of(self, job_id: str) -> int:
        """The queue shard a job belongs to (its indexes, its queue entry)."""
        if self.shards == 1:
            return 0
        return zlib.crc32(job_id.encode()) % self.shards

    def _q(self, shard: int) -> str:
        """The prefix of a shard's keys: the plain prefix on one Redis, else with its tag."""
        if not self.cluster:
            return self.prefix
        return f"{self.prefix}{{{self._tags[shard]}}}:"

    def queue(self, model: str, priority: Priority, shard: int = 0) -> str:
        """Stream of job ids waiting for a worker of `model`, one per priority (and shard)."""
        return f"{self._q(shard)}queue:{model}:{priority}"

    def overflow(self, model: str, priority: Priority, shard: int = 0) -> str:
        """Stream beside `queue`: the jobs of an owner past its fair share in flight wait here
        (workers take from it when the queue is empty, and every `overflow_share`-th claim)."""
        return f"{self._q(shard)}queue:{model}:{priority}:overflow"

    def fair_queue(self, model: str, priority: Priority, shard: int = 0) -> str:
        """Sorted set: keyed owners' jobs of a model's priority not yet in its queue, scored by
        their virtual finish time (token-fair scheduling: shared/lua/refill.lua)."""
        return f"{self._q(shard)}fairq:{model}:{priority}"

    def fair_clock(self, model: str, priority: Priority, shard: int = 0) -> str:
        """Hash beside `fair_queue`: the virtual time (`V`) and each owner's last finish time
        (`o:<owner>`)."""
        return f"{self._q(shard)}fairvt:{model}:{priority}"

    def lanes(self, model: str, priority: Priority, shard: int = 0) -> tuple[str, str]:
        """The two streams of a model's priority: (queue, overflow)."""
        return self.queue(model, priority, shard), self.overflow(model, priority, shard)

    def all_lanes(self, model: str, priority: Priority) -> list[str]:
        """The queue and overflow of a model's priority in every shard (on one Redis: the
        two of `lanes`). KEDA's lag trigger reads each: one trigger per stream, summed."""
        return [lane for s in range(self.shards) for lane in self.lanes(model, priority, s)]

    def placed(self, model: str, priority: Priority, worker_id: str, shard: int = 0) -> str:
        """Stream: one worker's own lane of a model's priority (placement: jobs whose prompt
        its cache holds wait here for it, a bounded time, before any worker may take them)."""
        return f"{self._q(shard)}queue:{model}:{priority}:w:{worker_id}"

    def placed_prefix(self, model: str, priority: Priority, shard: int = 0) -> str:
        """What every worker's lane of a model's priority starts with (then its worker id)."""
        return f"{self._q(shard)}queue:{model}:{priority}:w:"

    def queue_prefix(self, shard: int = 0) -> str:
        """What every queue key of a shard starts with (then the model and priority)."""
        return f"{self._q(shard)}queue:"

    def placed_lanes(self, shard: int = 0) -> str:
        """Set: every worker lane that was ever given a job (the steal sweep walks it)."""
        return f"{self._q(shard)}placed-lanes"

    def pending(self, shard: int) -> str:
        """Cluster only. Hash: job id → its queue entry (packed), for each submit whose record
        may be written but whose queue entry is not yet; the step that queues a job takes it
        off, in the same script (so a job is queued once), and the reconciler queues what a
        crashed submit left (gateway/deadline_sweep.py)."""
        return f"{self._q(shard)}pending"

    def pending_since(self, shard: int) -> str:
        """Cluster only. Sorted set beside `pending`: the same job ids, scored by when their
        submit began (unix seconds): the reconciler looks only at those older than a grace."""
        return f"{self._q(shard)}pending-since"

    def cache_summary(self, worker_id: str) -> str:
        """String with TTL: the page hashes a worker's engine cache holds (shared/pages.py),
        8 bytes each, most recently used last."""
        return f"{self.prefix}cache:{worker_id}"

    def cache_news(self) -> str:
        """Pub/sub channel: changes of workers' caches and loads, and jobs gateways placed
        (`shared.records.CacheNews`); the summary above is what a listener that missed one
        reads again."""
        return f"{self.prefix}cache-news"

    def job(self, job_id: str) -> str:
        """Hash: the job record."""
        return f"{self.prefix}job:{{{job_id}}}"

    @property
    def _webhooks(self) -> str:
        """The prefix of the webhook keys: one slot on a cluster (`{webhooks}`), as the
        sender's MULTI (acks, delivery records, the due set) needs."""
        return f"{self.prefix}{{webhooks}}:" if self.cluster else f"{self.prefix}webhooks:"

    def webhook_outbox(self) -> str:
        """Stream + consumer group: jobs and batches that ended with an event to send, written
        in the step that ends them (JobRecord.notify, BATCH_UPDATE); gateway/webhooks.py."""
        return f"{self._webhooks}outbox"

    def webhook_delivery(self, delivery_id: str) -> str:
        """Hash: one event to one endpoint (its body, URL, attempts; never the secret)."""
        return f"{self._webhooks}delivery:{delivery_id}"

    def webhook_due(self) -> str:
        """Sorted set: deliveries by when their next attempt is due."""
        return f"{self._webhooks}due"

    def webhook_dead(self) -> str:
        """Stream (capped): deliveries given up on, with why."""
        return f"{self._webhooks}dead"

    def webhook_disabled(self) -> str:
        """Set: endpoint URLs that answered 410 Gone (nothing more is sent there)."""
        return f"{self._webhooks}disabled"

    def webhook_lease(self) -> str:
        """String with TTL: the gateway process sending webhooks now."""
        return f"{self._webhooks}lease"

    def response(self, job_id: str) -> str:
        """String (JSON): what a Responses API response keeps beside its job (its owner,
        parameters and conversation: gateway/openai/responses.py), in the job's slot."""
        return f"{self.prefix}response:{{{job_id}}}"

    def events(self, job_id: str) -> str:
        """Stream: the job's event log; entry id `0-<seq>`."""
        return f"{self.prefix}events:{{{job_id}}}"

    def channel(self, job_id: str) -> str:
        """Pub/sub channel: the job's live events."""
        return f"{self.prefix}chan:{{{job_id}}}"

    def worker(self, worker_id: str) -> str:
        """Hash with TTL: a worker's heartbeat."""
        return f"{self.prefix}worker:{worker_id}"

    def workers(self) -> str:
        """Sorted set: worker id scored by its lease expiry (unix seconds)."""
        return f"{self.prefix}workers"

    def stopped_workers(self) -> str:
        """Hash: worker id → shared.records.StoppedWorker (a crash-looping process its
        launcher stopped alone)."""
        return f"{self.prefix}workers:stopped"

    def control(self, worker_id: str) -> str:
        """Pub/sub channel: commands to one worker (cancel)."""
        return f"{self.prefix}ctl:{worker_id}"

    def model_card(self, model: str) -> str:
        return f"{self.prefix}model:{model}"

    def models(self) -> str:
        """Set: names of models that have a card."""
        return f"{self.prefix}models"

    def recent_jobs(self, shard: int = 0) -> str:
        """Stream, capped (GENQ_RECENT_JOBS): an entry (`shared.records.RecentJob`) per job
        submitted and per job ended, in the script that does it; the dashboard's recent jobs.
        On a cluster, one per queue shard (of its jobs)."""
        return f"{self._q(shard)}recent"

    def deadlines(self, shard: int = 0) -> str:
        """Sorted set: ids of jobs with a timeout, scored by their deadline (unix seconds).
        On a cluster, one per queue shard (of its jobs)."""
        return f"{self._q(shard)}deadlines"

    def compact_due(self, shard: int = 0) -> str:
        """Sorted set: ids of ended jobs scored by when their event log is compacted (unix
        seconds). On a cluster, one per queue shard (of its jobs)."""
        return f"{self._q(shard)}compactdue"

    def dead_letters(self) -> str:
        return f"{self.prefix}dead"

    def lock(self, name: str) -> str:
        """String with TTL: held by the one process doing `name` now (e.g. a sweep)."""
        return f"{self.prefix}lock:{name}"

    def fleet_metrics_lease(self) -> str:
        """String with TTL: the one gateway process exporting the fleet's gauges now."""
        return f"{self.prefix}lock:fleet-metrics"

    def idempotency(self, owner: str, key: str, part: int = 0) -> str:
        """String: an owner's Idempotency-Key → the job it made. Part i > 0 of a request
        that makes several jobs (OpenAI's n, prompt lists) is `<key> #i`: a space is not
        allowed in a client's key, so no other key names it."""
        suffix = f" #{part}" if part else ""
        return f"{self.prefix}idem:{owner}:{key}{suffix}"

    def _admission(self, stripe: int) -> str:
        """The prefix of an admission stripe's keys: `{admission}` on one Redis (one stripe),
        else the stripe's queue shard's tag (shared/quotas.py)."""
        if not self.cluster:
            return f"{self.prefix}{{admission}}:"
        return f"{self._q(stripe)}admission:"

    @property
    def stripes(self) -> range:
        """The admission stripes: one per queue shard on a cluster, one on a single Redis."""
        return range(self.shards)

    def admission_counts(self, stripe: int = 0) -> str:
        """Hash: jobs and tokens admitted and not ended, per counter field (`scope_fields`)."""
        return f"{self._admission(stripe)}counts"

    def admission_jobs(self, stripe: int = 0) -> str:
        """Hash: job record key → what its admission added (tokens, then counter fields)."""
        return f"{self._admission(stripe)}jobs"

    def admission_checks(self, stripe: int = 0) -> str:
        """Sorted set: job record key of each admitted job, scored by when to check next
        that it has not ended unseen (the counters' repair)."""
        return f"{self._admission(stripe)}checks"

    def rate_limit(self, owner: str) -> str:
        """Hash with TTL: an owner's request token bucket."""
        if self.cluster:  # with its tokens bucket, in the owner's slot (RATE_LIMIT reads both)
            return f"{self.prefix}{{o:{owner}}}:rate"
        return f"{self.prefix}rate:{owner}"

    def tokens_rate(self, owner: str) -> str:
        """Hash with TTL: an owner's tokens-per-minute bucket (prompt + max_tokens of its jobs)."""
        if self.cluster:
            return f"{self.prefix}{{o:{owner}}}:tpm"
        return f"{self.prefix}tpm:{owner}"

    def write_probe(self) -> str:
        """String with TTL: what readiness writes to learn whether Redis takes writes."""
        return f"{self.prefix}probe"

    def gateways(self) -> str:
        """Sorted set: gateway process ids scored by their last heartbeat (unix seconds)."""
        return f"{self.prefix}gateways"

    def gateway_jobs(self, gateway_id: str) -> str:
        """Set: jobs a gateway process streams with cancel-on-disconnect (cancelled if it
        dies and nobody resumes them)."""
        return f"{self.prefix}gwjobs:{gateway_id}"

    def gateway_sweep(self) -> str:
        """String with TTL: the gateway process that sweeps dead gateways' jobs this round."""
        return f"{self.prefix}gwsweep"

    def resumed(self, job_id: str) -> str:
        """String with TTL: a client resumed the job through its events route; a dead
        gateway's sweep leaves it running."""
        return f"{self.prefix}resumed:{{{job_id}}}"

    # ---- files and batches (OpenAI Files and Batches API): tagged per file, per batch ----

    def file(self, file_id: str) -> str:
        """Hash: a file's record (shared.batches.FileRecord)."""
        return f"{self.prefix}file:{{{file_id}}}"

    def file_data(self, file_id: str) -> str:
        """List: a file's content, in chunks of whole lines."""
        return f"{self.prefix}filedata:{{{file_id}}}"

    def file_upload(self, file_id: str, token: str) -> str:
        """List: content being written; renamed to `file_data` once whole (short TTL)."""
        return f"{self.prefix}fileupload:{{{file_id}}}:{token}"

    def files(self) -> str:
        """Sorted set: file ids scored by creation time (the listing)."""
        return f"{self.prefix}files"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's record (shared.batches.BatchRecord)."""
        return f"{self.prefix}batch:{{{batch_id}}}"

    def batch_results(self, batch_id: str, kind: str) -> str:
        """Hash: line number → its output line (`out`) or error line (`err`), until the
        batch's files are written."""
        return f"{self.prefix}batch{kind}:{{{batch_id}}}"

    def batch_done(self, batch_id: str) -> str:
        """Stream + consumer group: ids of the batch's jobs that ended (JobRecord.done_stream)."""
        return f"{self.prefix}batchdone:{{{batch_id}}}"

    def batch_lease(self, batch_id: str) -> str:
        """String with TTL: the process driving the batch (queueing, cancel, finalizing)."""
        return f"{self.prefix}batchlease:{{{batch_id}}}"

    def batch_line(self, batch_id: str, line: int) -> str:
        """String with TTL: the idempotency claim that makes one line one job, once."""
        return f"{self.prefix}batchline:{{{batch_id}}}:{line}"

    def batches(self) -> str:
        """Sorted set: batch ids scored by creation time (the listing)."""
        return f"{self.prefix}batches"

    def active_batches(self) -> str:
        """Sorted set: ids of batches not yet ended, scored by their deadline."""
        return f"{self.prefix}batches:active"


def scope_fields(priority: Priority, model: str, owner: str | None = None) -> tuple[str, str]:
    """The (jobs, tokens) counter fields of one admission scope: a model's queue of one
    priority, for all owners (`owner` None) or one. The model goes last: it may hold `|`."""
    scope = f"{owner or '*'}|{priority}|{model}"
    return f"jobs|{scope}", f"tokens|{scope}"


MAX_SEQ = 2**64 - 1
"""The largest seq an event can have: a stream entry id's sequence part is 64 bits."""


def event_id(seq: int) -> str:
    """Stream entry id of event `seq` in a job's log: explicit ids make a replayed write fail."""
    return f"0-{seq}"


def seq_of(entry_id: str | bytes) -> int:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(s.partition("-")[2])


def keys_for(prefix: str, cluster: bool, shards: int) -> Keys:
    """The keys of a deployment: its prefix, and the slot plan when on a cluster."""
    return Keys(prefix, cluster=cluster, shards=shards if cluster else 1)
