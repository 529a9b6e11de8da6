"""Cache-aware placement: a job goes to the worker whose prefix cache holds the most of its
prompt, in the durable queue itself, when that is where it starts soonest.

Every gateway process keeps a copy of what each worker's cache holds (page hash chains,
shared/pages.py) and how loaded it is, kept true the moment it changes:

- a worker's cache news (`shared.records.CacheNews`, on `Keys.cache_news`), sent with the
  flush that starts or ends its jobs, says which pages its cache took in (a prompt as its job
  starts; the prompt and the reply as it ends, before the end is written) and dropped, and its
  load: slots free, jobs waiting in its lanes, its measured prefill rate and prefill backlog,
  how long a job holds a slot;
- a gateway that places a job records at once that the prompt's pages will be on that worker,
  and tells the others (the news goes out with the submit);
- the summary each worker writes with its heartbeat (`Keys.cache_summary`) is read again only
  when news was missed: the versions in the news have a gap, the pub/sub connection dropped,
  or a beat names a version not heard of (`refresh`, every `GENQ_PLACEMENT_REFRESH_S`).

For a job, `decide` computes the chain of its prompt and, per live worker of its model, how
much of it that worker holds and when the job would start there: the wait for a slot (jobs
ahead of it, at the pace slots free up), the prefill queued before it, and its own prefill of
what is not cached, at the worker's measured rate. Then:

- `prefix`: the worker holding the most of the prompt (`GENQ_PLACEMENT_MIN_PAGES` pages at
  least, more than some other worker holds) gets the job in its own lane when it is where the
  job starts soonest, and is not loaded past `GENQ_PLACEMENT_MAX_LOAD` (jobs running, waiting
  and placed, over its batch size). The job waits there only as long as waiting still beats
  the soonest start elsewhere, recomputing the prefix (the entry's `wait_ms`, never past
  `GENQ_PLACEMENT_WAIT_S`); a worker that has not measured its prefill rate yet is given a
  job only while it has a slot free;
- `key`: with no such prefix, a job naming a conversation (`prompt_cache_key`, else `user`)
  goes to the worker that key hashes to among the live ones (rendezvous hashing: a worker
  joining or leaving moves only its own keys) while it has a slot free and no worker has less
  prefill queued, so a conversation whose first turn is short still keeps to one worker; such
  a job saves nothing by waiting;
- `shared`: otherwise, or with placement off, the model's shared queue, where the first
  worker with room takes it.

A placed job waits in that worker's own lane (`Keys.placed`), which it reads before the shared
queue. `StealSweep` (one gateway process per round) moves every job that waited in a lane past
its `wait_ms` to the shared queue, and all of a dead worker's at once; what a dead worker had
started is pending in its lane's group and is reclaimed like any entry. Leases, fencing,
continuation, priorities, deadlines, quotas and dead letters are those of any queue entry: a
lane is one more stream of the model.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from gateway.pubsub import PubSubRouter, Subscription
from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys, Priority
from shared.loops import REDIS_FAILURES, keep_running, one_process_each_round
from shared.pages import PAGE_TOKENS, pack_summary, page_hashes, shared_pages, unpack_summary
from shared.records import CacheNews, Heartbeat, RecordError
from shared.schemas import JobSpec
from shared.settings import GatewaySettings
from shared.transitions import ScriptRunner, Transitions

log = logging.getLogger(__name__)

STEAL_BATCH = 500
"""Lane entries one steal call looks at."""
OUTCOMES = ("prefix", "key", "shared", "stolen")
NEWS_KEPT = 256
"""Most cache news of one worker kept for catching up (a summary read covers older ones)."""
MEET_WAIT_S = 0.05
"""The most a submit waits for a meeting of new workers under way (`Placement.met`)."""
PROMPTS_KEPT = 4096
"""Prompts' page chains kept for `Placement.ended`: a job still running past this many later
ones is left to its worker's cache news."""


@dataclass
class _Worker:
    beat: Heartbeat
    pages: set[int] = field(default_factory=set)
    version: int = -1
    """The cache version `pages` is at; -1: stale (news was missed), read the summary."""
    seq: int = 0
    """The worker's last news applied."""
    active: int = 0
    waiting: int = 0
    free: int = 0
    job_s: float = 0.0
    prefill_tps: float = 0.0
    prefill_backlog: int = 0
    lane: int = 0
    """Jobs waiting in its lanes, as its last news counted them."""
    placed: int = 0
    """Jobs placed there (by this process, or others that said so) since its last news."""
    placed_tokens: int = 0
    """Their prompt tokens not cached there: prefill queued before the next job's (an engine
    that prefills one job after another)."""
    prefill_serial: bool = False
    heard_at: float = 0.0
    """When its last news came (monotonic)."""
    log: dict[int, CacheNews] = field(default_factory=dict)
    """Its cache news not yet covered by a summary read, by the version each starts from:
    news that overtook an earlier one waits here for it, and a summary read (older than the
    news heard meanwhile) is brought up to date from here."""

    def __post_init__(self) -> None:
        self.take_load(self.beat)

    def hear(self, news: CacheNews) -> None:
        """A news of its own: the newest load; the cache's changes in version order."""
        if news.seq > self.seq:
            self.seq = news.seq
            self.take_load(news)
            self.lane, self.heard_at = news.lane, time.monotonic()
        if news.version > news.since and news.version > self.version:
            if len(self.log) >= NEWS_KEPT:  # never read back: the oldest goes
                del self.log[min(self.log)]
            self.log[news.since] = news
            self.catch_up()

    def catch_up(self, bridge: bool = False) -> None:
        """Apply the logged changes that follow on from `version`, in order; one that came
        before the change it follows waits for it. With `bridge`, past a change never heard
        too (right after a summary read: what came since it is the newest word there is)."""
        while self.version >= 0:
            news = self.log.get(self.version) or next(
                (n for n in self.log.values() if n.since < self.version < n.version), None
            )
            if news is None and bridge:
                later = [n for n in self.log.values() if n.since > self.version]
                news = min(later, key=lambda n: n.since, default=None)
            if news is None:
                return
            self.pages.difference_update(unpack_summary(news.dropped))
            self.pages.update(unpack_summary(news.added))
            self.version = news.version

    def read(self, summary: str | None, version: int) -> None:
        """Its summary, written with its beat of cache `version`: what it held then, brought
        up to date by the news heard since (all of it: a summary is as old as the last beat,
        and a change missed in between must not hide every one after it)."""
        self.pages = set(unpack_summary(summary))
        self.version = version
        for since in [v for v, n in self.log.items() if n.version <= version]:
            del self.log[since]
        self.catch_up(bridge=True)

    def take_load(self, source: Heartbeat | CacheNews) -> None:
        self.active, self.waiting, self.free = source.active, source.waiting, source.free
        self.job_s, self.prefill_tps = source.job_s, source.prefill_tps
        self.prefill_backlog, self.prefill_serial = source.prefill_backlog, source.prefill_serial
        self.placed = self.placed_tokens = 0

    def load(self) -> float:
        jobs = self.active + self.waiting + self.lane + self.placed
        return jobs / max(1, self.beat.capacity)

    def has_room(self) -> bool:
        """A slot free for one more job, counting those waiting for it."""
        return self.free - self.lane - self.placed > 0

    def wait_s(self, tps: float) -> float:
        """Expected seconds before a job placed here now begins its own prefill: its turn for
        a slot (the jobs ahead of it, at the pace slots free up), then the prefill of the
        jobs started before it (at `tps`, prompt tokens a second). Without a slot, and with
        no job ended yet to tell how long one takes: no telling (infinite)."""
        behind = self.waiting + self.lane + self.placed + 1 - self.free
        if behind > 0 and not self.job_s:
            return math.inf
        slot = behind * self.job_s / max(1, self.active) if behind > 0 else 0.0
        if not self.prefill_serial or tps <= 0:
            return slot
        return slot + (self.prefill_backlog + self.placed_tokens) / tps


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: str
    lane: str | None = None
    """The worker lane (`Keys.placed`); None for the shared queue."""
    wait_ms: int | None = None
    """How long the job may wait in `lane` (`QueueEntry.wait_ms`)."""
    news: str = ""
    """What the other gateways are told when the job is placed (`CacheNews`, encoded)."""


@dataclass
class Placement:
    settings: GatewaySettings
    redis: aioredis.Redis
    keys: Keys
    live_workers: Callable[[], Any]
    """The registry's `live_workers` (awaitable: the live heartbeats)."""
    counted: Callable[[str], None] = lambda outcome: None
    """Told each decision's outcome (the gateway's metrics)."""
    workers: dict[str, _Worker] = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This process, as its placement news names it (it ignores its own)."""
    _cached: dict[str, int] = field(default_factory=dict)
    _refreshed_at: float = 0.0
    _early: dict[str, list[CacheNews]] = field(default_factory=dict)
    """News of workers not met yet (by worker id), for the refresh that meets them."""
    _ended_early: dict[str, set[int]] = field(default_factory=dict)
    """Prompt pages of jobs that ended on workers not met yet (`ended`), for that refresh."""
    _meeting: asyncio.Future[None] | None = None
    _news: Subscription | None = None
    """The cache-news subscription, once `listen` made it."""
    _caught_up: bool = False
    """`catch_up` took news since the listener's last round."""
    _prompts: dict[str, list[int]] = field(default_factory=dict)
    """The page chains of prompts this process placed or queued, by job id, until the job's
    end is seen here (`ended`); the oldest go past `PROMPTS_KEPT`."""

    async def run(self) -> None:
        await keep_running(
            self.refresh,
            failed="placement refresh failed",
            log=log,
            every_s=self.settings.placement_refresh_s,
            redis=self.redis,
        )

    async def listen(self, router: PubSubRouter) -> None:
        """Apply every cache news as it comes. A wake without news (the connection came back,
        its SUBSCRIBE was confirmed, or this listener fell behind) may hide some: every
        worker's summary is read again at the next refresh, and brought up to date by the news
        heard meanwhile and before (kept: the summary is as old as the worker's last beat).
        Until then each worker keeps the pages it was known to hold."""
        sub = self._news = await router.subscribe(self.keys.cache_news())
        try:
            while True:
                await sub.wake.wait()
                items = sub.take()
                if not items and not self._caught_up:
                    for w in self.workers.values():
                        w.version = -1
                self._caught_up = False
                for text in items:
                    self.hear(text)
        finally:
            await sub.close()

    def catch_up(self) -> None:
        """Apply the news this process has been handed and its listener not yet taken: a
        submit that comes between the two (a follow-up sent the moment its turn ended, under
        load) places on what the worker said, not on what it said before."""
        sub = self._news
        if sub is not None and sub.buffer and not sub.behind:  # a wake without news: theirs
            self._caught_up = True  # the wake it leaves behind is not one without news
            for text in sub.take():
                self.hear(text)

    def hear(self, text: str) -> None:
        """One cache news (`CacheNews`): a worker's, or another gateway's placement."""
        try:
            news = CacheNews.decode(text)
        except RecordError as exc:
            log.warning("unreadable cache news", extra={"error": str(exc)})
            return
        w = self.workers.get(news.worker)
        if news.gateway:
            if w is not None and news.gateway != self.id:  # its own is recorded already
                w.pages.update(unpack_summary(news.added))
                w.placed += news.placed
        elif w is not None:
            w.hear(news)
        else:  # a worker not met yet: met now, its summary brought up to date by its news
            early = self._early.setdefault(news.worker, [])
            if len(early) < NEWS_KEPT:
                early.append(news)
            self._start_meeting()

    def _start_meeting(self) -> None:
        if self._meeting is None or self._meeting.done():
            self._meeting = asyncio.ensure_future(self._meet())

    async def met(self) -> None:
        """Wait for a meeting of new workers under way (at most `MEET_WAIT_S`): a follow-up
        sent the moment its turn ended on a worker this process had not met yet is placed
        knowing it."""
        meeting = self._meeting
        if meeting is not None and not meeting.done():  # its failure is the refresh loop's
            await asyncio.wait({meeting}, timeout=MEET_WAIT_S)

    async def _meet(self) -> None:
        try:
            await self.refresh()
        except REDIS_FAILURES as exc:  # the loop's next round reads them again
            log.debug("placement refresh failed", extra={"error": str(exc)})

    async def refresh(self) -> None:
        """Read the live workers' beats, and the summaries of those whose news was missed
        (also with placement off: token-fair scheduling estimates cached prompts from them)."""
        beats: list[Heartbeat] = await self.live_workers()
        known, self.workers = self.workers, {}
        stale: list[_Worker] = []
        last, self._refreshed_at = self._refreshed_at, time.monotonic()
        early, self._early = self._early, {}
        for beat in beats:
            if beat.draining or beat.engine_down:
                continue
            w = known.get(beat.worker_id)
            if w is None:
                w = _Worker(beat)
                for news in early.get(beat.worker_id, []):
                    w.hear(news)
            elif w.beat.beat_at != beat.beat_at and w.heard_at < last:
                w.take_load(beat)  # silent since: its beat is the newest word
            w.beat = beat
            self.workers[beat.worker_id] = w
            if w.version < 0 or beat.cache_version > w.version:
                stale.append(w)
        if stale:
            pipe = self.redis.pipeline(transaction=False)
            for w in stale:
                pipe.get(self.keys.cache_summary(w.beat.worker_id))
            for w, text in zip(stale, await pipe.execute(), strict=True):
                w.read(text, w.beat.cache_version)
        ended, self._ended_early = self._ended_early, {}
        for worker_id, pages in ended.items():  # after the reads: newer than the summaries
            if (w := self.workers.get(worker_id)) is not None:
                w.pages.update(pages)

    def decide(self, spec: JobSpec, conversation: str | None = None) -> Decision:
        """Where `spec` goes: a worker's lane (how long it may wait there, and the news that
        tells the other gateways), or the shared queue."""
        self.catch_up()
        decision, worker, chain = self._choose(spec, conversation)
        self.counted(decision.outcome)
        if chain and self.settings.placement:
            self._prompts[spec.id] = chain
            if len(self._prompts) > PROMPTS_KEPT:
                del self._prompts[next(iter(self._prompts))]
        if worker is None:
            return decision
        worker.placed += 1
        worker.placed_tokens += (
            len(spec.input_ids) - shared_pages(chain, worker.pages) * PAGE_TOKENS
        )
        worker.pages.update(chain)  # on its way there: the next job with this prefix follows
        shard = self.keys.shard_of(spec.id)  # on a cluster, the worker's lane in the job's
        lane = self.keys.placed(spec.model, spec.priority, worker.beat.worker_id, shard)
        news = CacheNews(
            worker=worker.beat.worker_id, gateway=self.id, placed=1, added=pack_summary(chain)
        )
        return Decision(decision.outcome, lane, decision.wait_ms, news.encode())

    def ended(self, job_id: str, worker: str) -> None:
        """This process saw job `job_id` end on `worker` (its stream's `done`, or its record):
        the worker holds the job's prompt now. Its own cache news says so too, but that may
        still sit unread in this process's pub/sub socket when the follow-up, sent the moment
        the answer came, is placed (a job that went to the shared queue is placed nowhere)."""
        chain = self._prompts.pop(job_id, None)
        if not chain:
            return
        w = self.workers.get(worker)
        if w is not None:
            w.pages.update(chain)
        elif worker in self._ended_early or len(self._ended_early) < NEWS_KEPT:
            self._ended_early.setdefault(worker, set()).update(chain)  # met at the refresh
            self._start_meeting()

    def lane(self, spec: JobSpec, conversation: str | None = None) -> str | None:
        """The worker lane for `spec` (`Keys.placed`), or None for the shared queue."""
        return self.decide(spec, conversation).lane

    def cached_tokens(self, spec: JobSpec) -> int:
        """Of `spec`'s prompt, the most some live worker's cache holds (tokens; an estimate:
        what token-fair scheduling does not charge as prefill). Set by `decide`."""
        return self._cached.get(spec.id, 0)

    def _choose(
        self, spec: JobSpec, conversation: str | None
    ) -> tuple[Decision, _Worker | None, list[int]]:
        s = self.settings
        candidates = [w for w in self.workers.values() if w.beat.model == spec.model]
        chain = page_hashes(spec.input_ids) if candidates or s.placement else []
        held = {id(w): shared_pages(chain, w.pages) * PAGE_TOKENS for w in candidates}
        most = max(held.values(), default=0)
        self._cached = {spec.id: most}
        if not s.placement or len(candidates) < 2:  # one worker: its lane is the shared queue
            return Decision("shared"), None, chain
        known = [w.prefill_tps for w in candidates if w.prefill_tps > 0]
        tps = sum(known) / len(known) if known else 0.0
        waits = {id(w): w.wait_s(w.prefill_tps or tps) for w in candidates}
        if most >= s.placement_min_pages * PAGE_TOKENS and most > min(held.values()):
            holders = [
                w for w in candidates if held[id(w)] == most and w.load() < s.placement_max_load
            ]
            if holders:
                holder = self._soonest(spec, holders, held, waits, tps)
                wait_ms = self._worth_waiting(spec, holder, candidates, held, waits)
                if wait_ms is not None:
                    return Decision("prefix", wait_ms=wait_ms), holder, chain
        least = min(waits[id(w)] for w in candidates)
        if conversation:
            w = _rendezvous(conversation, candidates)
            if w.load() < s.placement_max_load and w.has_room() and waits[id(w)] <= least:
                return Decision("key", wait_ms=0), w, chain
        return Decision("shared"), None, chain

    @staticmethod
    def _soonest(
        spec: JobSpec,
        holders: list[_Worker],
        held: dict[int, int],
        waits: dict[int, float],
        tps: float,
    ) -> _Worker:
        """Of the workers holding the most of the prompt, the one where it starts soonest:
        its wait, then the prefill of what it does not hold. Two holding the same prefix (an
        agent's turns ran on both) are told apart by their pace, so the job goes to the
        quicker one instead of to the shared queue. (A worker holding less, a shared system
        prompt say, is no reason to place: the shared queue finds a free worker sooner.)"""
        if tps <= 0:  # no prefill rate known: the shortest wait
            return min(holders, key=lambda w: waits[id(w)])
        uncached = len(spec.input_ids) - held[id(holders[0])]  # the same for every holder
        return min(holders, key=lambda w: waits[id(w)] + uncached / (w.prefill_tps or tps))

    def _bound_ms(self) -> int:
        return int(self.settings.placement_wait_s * 1000)

    def _worth_waiting(
        self,
        spec: JobSpec,
        holder: _Worker,
        candidates: list[_Worker],
        held: dict[int, int],
        waits: dict[int, float],
    ) -> int | None:
        """How long the job may wait for `holder`, the worker holding most of its prompt, if
        that is where it starts soonest; else None."""
        s = self.settings
        bound_ms = self._bound_ms()
        prompt = len(spec.input_ids)
        known = [w.prefill_tps for w in candidates if w.prefill_tps > 0]
        if holder.prefill_tps <= 0 or not known:  # nothing measured yet: no waiting
            return bound_ms if holder.has_room() else None
        fallback = sum(known) / len(known)

        def start_s(w: _Worker) -> float:
            return waits[id(w)] + (prompt - held[id(w)]) / (w.prefill_tps or fallback)

        own_s = (prompt - held[id(holder)]) / holder.prefill_tps
        here = start_s(holder)
        elsewhere = min((start_s(w) for w in candidates if w is not holder), default=here)
        if here > elsewhere or math.isinf(here):
            return None
        if holder.has_room() and not holder.prefill_serial:  # it starts at once: only a
            return bound_ms  # worker that stopped taking jobs keeps it, and the bound is for that
        # It may wait until recomputing the prefix elsewhere would have started it sooner (at
        # least one sweep: the sweep acts no sooner anyway).
        # No other worker's start known (full, none of its jobs ended yet): the bound.
        budget_s = max(elsewhere - own_s, s.placement_sweep_s)
        return bound_ms if math.isinf(budget_s) else min(bound_ms, int(budget_s * 1000))


def _rendezvous(key: str, workers: Sequence[_Worker]) -> _Worker:
    """The worker `key` hashes to (highest random weight): stable while it lives."""

    def weight(w: _Worker) -> bytes:
        return hashlib.blake2b(f"{key}\0{w.beat.worker_id}".encode(), digest_size=8).digest()

    return max(workers, key=weight)


class StealSweep:
    """One gateway process per round moves jobs that waited too long in a worker's lane, and
    every job waiting in a dead worker's, to the shared queue."""

    def __init__(
        self,
        settings: GatewaySettings,
        redis: aioredis.Redis,
        scripts: ScriptRunner,
        keys: Keys,
        counted: Callable[[str, int], None] = lambda outcome, n: None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.transitions = Transitions(keys)
        self.counted = counted

    async def run(self) -> None:
        await one_process_each_round(
            self.sweep,
            lock=self.keys.lock("steal-sweep"),
            failed="steal sweep failed",
            log=log,
            every_s=self.settings.placement_sweep_s,
            redis=self.redis,
        )

    async def sweep(self) -> int:
        """Jobs moved to shared queues this round."""
        parsed: list[tuple[str, tuple[str, Priority, str, int]]] = []
        for shard in range(self.keys.shards):  # each queue shard's lanes (one on one Redis)
            lanes = sorted(await self.redis.smembers(self.keys.placed_lanes(shard)))
            parsed += [(lane, p) for lane in lanes if (p := self._parse(lane, shard)) is not None]
        if not parsed:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for _, (_, _, worker, _) in parsed:
            pipe.exists(self.keys.worker(worker))
        alive = await pipe.execute()
        older_ms = int(self.settings.placement_wait_s * 1000)
        calls = [
            self.transitions.steal(
                lane,
                self.keys.queue(model, priority, shard),
                group=CONSUMER_GROUP,
                older_ms=older_ms,
                dead=not up,
                limit=STEAL_BATCH,
                shard=shard,
            )
            for (lane, (model, priority, _, shard)), up in zip(parsed, alive, strict=True)
        ]
        moved = 0
        for (lane, _), reply in zip(parsed, await self.scripts.run_all(calls), strict=True):
            if isinstance(reply, Exception):
                log.warning("steal failed", extra={"queue": lane, "error": str(reply)})
                continue
            moved += reply[0]
        if moved:
            self.counted("stolen", moved)
            log.info("jobs moved from worker lanes to shared queues", extra={"jobs": moved})
        return moved

    def _parse(self, lane: str, shard: int) -> tuple[str, Priority, str, int] | None:
        """(model, priority, worker, shard) of a lane key of queue shard `shard`; None for a
        key that is not one."""
        head, sep, worker = lane.rpartition(":w:")
        if not sep or not worker:
            return None
        head, _, priority = head.rpartition(":")
        prefix = self.keys.queue_prefix(shard)
        if priority not in PRIORITIES or not head.startswith(prefix):
            return None
        model = head[len(prefix) :]
        pri: Priority = "interactive" if priority == "interactive" else "batch"
        return model, pri, worker, shard
