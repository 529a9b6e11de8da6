"""Cache-aware placement: a job goes to the worker whose prefix cache holds the most of its
prompt, in the durable queue itself.

Each worker publishes what its engine's cache holds — the page hash chains of its jobs
(worker/cachemodel.py, shared/pages.py) — and how loaded it is (its heartbeat). Every gateway
process keeps a copy, read again when a worker's `cache_version` changes (`refresh`, every
`GENQ_PLACEMENT_REFRESH_S`). For a job, `lane` computes the chain of its prompt and picks:

- `prefix`: the live worker holding the longest prefix of it (`GENQ_PLACEMENT_MIN_PAGES` pages
  at least), unless that worker is loaded past `GENQ_PLACEMENT_MAX_LOAD` (jobs running and
  waiting, and those this process placed there since its beat, over its batch size);
- `key`: with no such prefix, a job naming a conversation (`prompt_cache_key`, else `user`)
  goes to the worker that key hashes to among the live ones (rendezvous hashing: a worker
  joining or leaving moves only its own keys), under the same load rule, so a conversation
  whose first turn is short still keeps to one worker;
- `shared`: otherwise, or with placement off, the model's shared queue, as before.

A placed job waits in that worker's own lane (`Keys.placed`), which it reads before the shared
queue. No job waits on a busy or dead worker: `StealSweep` (one gateway process per round)
moves every job waiting in a lane longer than `GENQ_PLACEMENT_WAIT_S` to the shared queue,
and all of a dead worker's at once; what a dead worker had started is pending in its lane's
group and is reclaimed like any entry. Leases, fencing, continuation, priorities, deadlines,
quotas and dead letters are those of any queue entry: a lane is one more stream of the model.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys, Priority
from shared.loops import keep_running, one_process_each_round
from shared.pages import PAGE_TOKENS, page_hashes, shared_pages, unpack_summary
from shared.records import Heartbeat
from shared.schemas import JobSpec
from shared.settings import GatewaySettings
from shared.transitions import ScriptRunner, Transitions

log = logging.getLogger(__name__)

STEAL_BATCH = 500
"""Lane entries one steal call looks at."""
OUTCOMES = ("prefix", "key", "shared", "stolen")


@dataclass
class _Worker:
    beat: Heartbeat
    pages: frozenset[int] = frozenset()
    version: int = -1
    placed: int = 0
    """Jobs this process placed there since its last heartbeat was read."""

    def load(self) -> float:
        b = self.beat
        return (b.active + b.waiting + self.placed) / max(1, b.capacity)


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
    _cached: dict[str, int] = field(default_factory=dict)

    async def run(self) -> None:
        await keep_running(
            self.refresh,
            failed="placement refresh failed",
            log=log,
            every_s=self.settings.placement_refresh_s,
            redis=self.redis,
        )

    async def refresh(self) -> None:
        """Read the live workers' beats, and the cache summaries that changed (also with
        placement off: token-fair scheduling estimates cached prompts from them)."""
        beats: list[Heartbeat] = await self.live_workers()
        known, self.workers = self.workers, {}
        stale: list[_Worker] = []
        for beat in beats:
            if beat.draining or beat.engine_down:
                continue
            w = known.get(beat.worker_id) or _Worker(beat)
            if w.beat.beat_at != beat.beat_at:
                w.placed = 0  # its beat counts what it took since
            w.beat = beat
            self.workers[beat.worker_id] = w
            if beat.cache_version != w.version:
                stale.append(w)
        if stale:
            pipe = self.redis.pipeline(transaction=False)
            for w in stale:
                pipe.get(self.keys.cache_summary(w.beat.worker_id))
            for w, text in zip(stale, await pipe.execute(), strict=True):
                w.pages = unpack_summary(text)
                w.version = w.beat.cache_version

    def lane(self, spec: JobSpec, conversation: str | None = None) -> str | None:
        """The worker lane for `spec` (`Keys.placed`), or None for the shared queue."""
        outcome, worker = self._choose(spec, conversation)
        self.counted(outcome)
        if worker is None:
            return None
        worker.placed += 1
        return self.keys.placed(spec.model, spec.priority, worker.beat.worker_id)

    def cached_tokens(self, spec: JobSpec) -> int:
        """Of `spec`'s prompt, the most some live worker's cache holds (tokens; an estimate:
        what token-fair scheduling does not charge as prefill). Set by `lane`."""
        return self._cached.get(spec.id, 0)

    def _choose(self, spec: JobSpec, conversation: str | None) -> tuple[str, _Worker | None]:
        s = self.settings
        candidates = [w for w in self.workers.values() if w.beat.model == spec.model]
        chain = page_hashes(spec.input_ids) if candidates else []
        best, most = None, 0
        for w in candidates:
            n = shared_pages(chain, w.pages) if chain else 0
            if n > most:
                best, most = w, n
        self._cached = {spec.id: most * PAGE_TOKENS}
        if not s.placement or not candidates:
            return "shared", None
        if best is not None and most >= s.placement_min_pages:
            if best.load() < s.placement_max_load:
                return "prefix", best
            return "shared", None
        if conversation:
            w = _rendezvous(conversation, candidates)
            if w.load() < s.placement_max_load:
                return "key", w
        return "shared", None


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
        lanes = sorted(await self.redis.smembers(self.keys.placed_lanes()))
        parsed = [(lane, p) for lane in lanes if (p := self._parse(lane)) is not None]
        if not parsed:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for _, (_, _, worker) in parsed:
            pipe.exists(self.keys.worker(worker))
        alive = await pipe.execute()
        older_ms = int(self.settings.placement_wait_s * 1000)
        calls = [
            self.transitions.steal(
                lane,
                self.keys.queue(model, priority),
                group=CONSUMER_GROUP,
                older_ms=older_ms,
                dead=not up,
                limit=STEAL_BATCH,
            )
            for (lane, (model, priority, _)), up in zip(parsed, alive, strict=True)
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

    def _parse(self, lane: str) -> tuple[str, Priority, str] | None:
        """(model, priority, worker) of a lane key; None for a key that is not one."""
        head, sep, worker = lane.rpartition(":w:")
        if not sep or not worker:
            return None
        head, _, priority = head.rpartition(":")
        prefix = f"{self.keys.prefix}queue:"
        if priority not in PRIORITIES or not head.startswith(prefix):
            return None
        model = head[len(prefix) :]
        pri: Priority = "interactive" if priority == "interactive" else "batch"
        return model, pri, worker
