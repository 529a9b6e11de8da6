"""The worker: claim → start → (engine thread steps) → flush events → finish, as asyncio tasks.

Phases, each a task (the module that holds it):
  claim      (claims.py) XREADGROUP from the model's queues (interactive first, every
             `batch_share`-th claim a batch job) only while the engine has room; START each
             claim atomically.
  flush      (flush.py) drain the engine's outputs; one pipeline per drain carries every job's
             events (EMIT/FINISH scripts, fenced on worker + attempt); ack what ended.
  heartbeat  (upkeep.py) refresh the heartbeat hash, the lease and the model card; touch held
             entries so their idle time stays low (a dead worker's entries go idle and are
             reclaimed); end running jobs past their deadline.
  reclaim    (upkeep.py) XCLAIM entries idle past the lease whose worker's heartbeat is gone.
  control    (control.py) the worker's control channel: cancels.
  summary    (summary.py) a summary line every GENQ_LOG_SUMMARY_INTERVAL_S (0: no phase).
  engine     (here) while the engine is down (its process died or stalled, and restarts),
             claims not started yet go back to the queue at once.

The engine runs in a process of its own (worker/engine_client.py) or, given an engine object,
on a thread of this one (worker/runner.py); the phases see either as an `EngineLink`.

The phases share one `WorkerState` (state.py) and let go of queue entries through
entries.py. This module holds the lifecycle: prepare, run the phases, drain, leave.

Every loop runs under a supervisor: an unexpected exception is logged and the loop restarts,
so no phase can die silently while the heartbeat keeps the worker looking alive.

An engine error on one job is not the job's end: the job is handed back to the queue for
another attempt (counted), and dead-lettered once its attempts are spent; the rest of the
batch goes on. A drain's hand-back (worker/drain.py) costs no attempt; it counts an
interruption.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.keys import CONSUMER_GROUP, PRIORITIES
from shared.loops import LOOP_RESTART_S
from shared.redis_health import failure_level
from shared.redisconn import connect
from shared.settings import WorkerSettings
from shared.transitions import ScriptRunner, Transitions
from worker.cachemodel import CacheModel, modelled_pages
from worker.claims import Claimer
from worker.control import Control
from worker.drain import drain
from worker.engine import Engine
from worker.entries import ensure_groups, requeue_waiting
from worker.flush import Flusher
from worker.lease import LeaseClock
from worker.link import EngineLink
from worker.metrics import WorkerMetrics
from worker.news import NewsDesk
from worker.runner import EngineRunner
from worker.state import WorkerState
from worker.summary import Summary
from worker.upkeep import Upkeep

log = logging.getLogger(__name__)
DEFAULT_REDIS_PORT = 6379
_TASK_STOP_TIMEOUT_S = 2.0
WAITING_LINE_S = 5.0
"""How often a worker waiting at start for Redis says so."""


class RedisStartTimeout(Exception):
    """Redis did not answer within GENQ_REDIS_START_TIMEOUT_S of the worker's start."""

    def __init__(self, limit_s: float, where: str) -> None:
        super().__init__(f"Redis at {where} did not answer within {limit_s:g} s of the start")
        self.limit_s = limit_s
        self.where = where


def redis_address(settings: WorkerSettings) -> str:
    """Where this worker looks for Redis, without its password: host:port/db, or the
    sentinels."""
    if settings.redis_sentinels:
        return f"sentinels {','.join(settings.redis_sentinels)}"
    parts = urlsplit(settings.redis_url or "")
    return f"{parts.hostname}:{parts.port or DEFAULT_REDIS_PORT}{parts.path}"


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine | EngineLink,
        *,
        redis: aioredis.Redis | None = None,
        model_name: str | None = None,
    ) -> None:
        """`engine`: an engine process's link (worker.engine_client.EngineProcess.spawn), or
        an engine object, then run on a thread of this process."""
        if not isinstance(engine, EngineLink):
            engine = EngineRunner(engine, detokenize=settings.detokenize == "worker")
        model = model_name or settings.model_name or engine.card.name
        engine.card.name = model
        if settings.chat_template is not None:  # e.g. a model whose tokenizer_config lacks one
            engine.card.chat_template = settings.chat_template
        worker_id = (
            settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        keys = settings.keys()
        client = redis or connect(settings)
        self.st = WorkerState(
            settings=settings,
            engine=engine,
            id=worker_id,
            model=model,
            keys=keys,
            redis=client,
            scripts=ScriptRunner(client),
            transitions=Transitions(keys, settings.recent_jobs, settings.event_compact_grace_s),
            queues={p: keys.queue(model, p) for p in PRIORITIES},
            overflow={p: keys.overflow(model, p) for p in PRIORITIES},
            placed={p: keys.placed(model, p, worker_id) for p in PRIORITIES},
            cache=CacheModel(
                modelled_pages(
                    engine.admission.page_size,
                    engine.admission.total_pages,
                    settings.sim_cache_tokens,
                )
            ),
            lease=LeaseClock(settings.lease_s),
            metrics=WorkerMetrics(
                model,
                worker_id,
                os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                engine.card.max_seq_len,
            ),
        )
        self.st.metrics.snapshot = self._gauges
        self.tell: Callable[[str], None] | None = None
        """Where its stop's plan is said in words too (`genq serve` prints it)."""
        self.st.pace.side_by_side = engine.prefill_side_by_side
        news = NewsDesk(self.st)
        self._claims = Claimer(self.st)
        self._flusher = Flusher(self.st, news)
        self._upkeep = Upkeep(self.st, news)
        self._control = Control(self.st)
        self._summary = Summary(self.st)

    def _gauges(self) -> tuple[int, int, float]:
        """Jobs running, claims waiting, KV cache in use: the metrics read them when scraped."""
        st = self.st
        return st.in_engine(), len(st.waiting), st.engine.admission.in_use()

    @property
    def tokens_per_s(self) -> float:
        return self._upkeep.tokens_per_s

    # ---- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until `stop()`; then stop claiming, let running jobs finish, and leave."""
        st = self.st
        try:
            await self._prepare_when_redis_answers()
        except BaseException:
            await st.engine.aclose()
            raise
        if st.stopping.is_set():
            await st.engine.aclose()
            return
        st.engine.start(asyncio.get_running_loop(), st.flush_wanted.set)
        log.info(
            "worker started",
            extra={"worker_id": st.id, "model": st.model, "engine_pid": st.engine.pid},
        )
        loops: dict[str, Callable[[], Awaitable[None]]] = {
            "claim": self._claims.loop,
            "flush": self._flusher.loop,
            "heartbeat": self._upkeep.heartbeat_loop,
            "reclaim": self._upkeep.reclaim_loop,
            "control": self._control.loop,
            "engine": self._engine_loop,
        }
        if st.settings.log_summary_interval_s > 0:
            loops["summary"] = self._summary.loop
        tasks = [asyncio.create_task(self._supervise(n, f), name=n) for n, f in loops.items()]
        try:
            await st.stopping.wait()  # the claim loop sees it too and claims no more
            await drain(st, st.settings.shutdown_grace_s, self.tell)
        finally:
            st.closing = True  # loops check it too: a swallowed cancel must not hang us
            st.flush_wanted.set()
            for t in tasks:
                t.cancel()
            # Bounded: a Redis client can swallow a cancel that races a read timeout.
            _, stuck = await asyncio.wait(tasks, timeout=_TASK_STOP_TIMEOUT_S)
            if stuck:
                log.warning("tasks did not stop", extra={"tasks": [t.get_name() for t in stuck]})
            await st.engine.aclose()
            with contextlib.suppress(RedisError, OSError):
                await self._leave()

    def stop(self, now: bool = False) -> None:
        """Stop claiming and drain (worker/drain.py): running jobs (but those nobody waits on
        any more) get `GENQ_SHUTDOWN_GRACE_S` to finish. `now` (the same signal again): every
        one is handed back to the queue at once."""
        self.st.stopping.set()
        if now:
            self.st.hurry.set()

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        self.st.cancel(job_id, reason)

    async def _supervise(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run one phase until closing: a crash is logged and the phase restarts."""
        while not self.st.closing:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker loop crashed; restarting it", extra={"loop": name})
                await asyncio.sleep(LOOP_RESTART_S)
                self.st.flush_wanted.set()  # whatever it was doing, the next flush picks up
                self.st.room.set()

    async def _engine_loop(self) -> None:
        """While the engine is down, claims not started yet go back to the queue (another
        worker can start them now); once it is back, the claim loop claims again."""
        st = self.st
        while not st.closing:
            await st.engine.changed.wait()
            st.engine.changed.clear()
            st.room.set()
            if st.engine.down is not None:
                log.warning(
                    "engine down; handing back unstarted claims",
                    extra={"worker_id": st.id, "why": st.engine.down, "claims": len(st.waiting)},
                )
                await requeue_waiting(st)

    async def _prepare_when_redis_answers(self) -> None:
        """A worker started while Redis is away waits for it, saying so every
        `WAITING_LINE_S`, until stopped or for GENQ_REDIS_START_TIMEOUT_S: then
        `RedisStartTimeout`. A Redis that accepts connections and never answers is bounded
        too: each try is cut off at the deadline, whatever the socket timeouts."""
        st = self.st
        limit = st.settings.redis_start_timeout_s
        began = time.monotonic()
        deadline = began + limit if limit > 0 else None
        telling = asyncio.create_task(self._tell_waiting(began, limit))
        stopping = asyncio.create_task(st.stopping.wait())
        try:
            while not st.stopping.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RedisStartTimeout(limit, redis_address(st.settings))
                attempt = asyncio.create_task(self._prepare())
                await asyncio.wait(
                    {attempt, stopping}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                if not attempt.done():
                    attempt.cancel()  # bounded: a Redis client can swallow a cancel
                    await asyncio.wait({attempt}, timeout=_TASK_STOP_TIMEOUT_S)
                    continue  # stopped, or past the deadline: the loop's checks say which
                try:
                    attempt.result()
                    return
                except (RedisError, OSError) as exc:
                    log.log(
                        failure_level(st.redis),
                        "Redis unreachable at start; retrying",
                        extra={"error": str(exc)},
                    )
                pause = st.settings.heartbeat_s
                if deadline is not None:
                    pause = min(pause, max(deadline - time.monotonic(), 0.0))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stopping), pause)
        finally:
            telling.cancel()
            stopping.cancel()

    async def _tell_waiting(self, began: float, limit: float) -> None:
        """A warning every `WAITING_LINE_S` while the start waits for Redis: one line per
        outage (shared/redis_health.py) would leave a worker that never starts silent."""
        where = redis_address(self.st.settings)
        while True:
            await asyncio.sleep(WAITING_LINE_S)
            waited = time.monotonic() - began
            extra: dict[str, object] = {"redis": where, "waited_s": round(waited, 1)}
            if limit > 0:
                extra["gives_up_in_s"] = round(max(limit - waited, 0.0), 1)
            log.warning("waiting for Redis to answer before starting", extra=extra)

    async def _prepare(self) -> None:
        await ensure_groups(self.st)
        await self._upkeep.publish_card()
        await self._upkeep.beat()

    async def _leave(self) -> None:
        st = self.st
        pipe = st.redis.pipeline(transaction=False)
        pipe.delete(st.keys.worker(st.id))
        pipe.zrem(st.keys.workers(), st.id)
        await pipe.execute()
        for key in st.all_streams():
            await st.scripts.run(
                st.transitions.delete_idle_consumer(key, group=CONSUMER_GROUP, consumer=st.id)
            )
