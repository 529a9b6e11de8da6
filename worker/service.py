"""The worker: claim → start → (engine thread steps) → flush events → finish, as asyncio tasks.

Phases, each a task:
  claim      XREADGROUP from the model's queues (interactive first, every `batch_share`-th
             claim a batch job) only while the engine has room; START each claim atomically.
  flush      drain the engine's outputs; one pipeline per drain carries every job's events
             (EMIT/FINISH scripts, fenced on worker + attempt); ack what ended.
  heartbeat  refresh the heartbeat hash, the lease and the model card; touch held entries so
             their idle time stays low (a dead worker's entries go idle and are reclaimed).
  reclaim    XAUTOCLAIM entries idle past the lease: their worker is gone.
  control    the worker's control channel: cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from shared import __version__
from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys, Priority
from shared.redisconn import connect
from shared.schemas import ControlMessage, Heartbeat, JobSpec
from shared.scripts import Scripts
from shared.settings import Settings
from worker.engine import Engine, EngineJob, StepOutput
from worker.jobstate import Claim, RunningJob
from worker.runner import EngineRunner

log = logging.getLogger("genq.worker")
_MAX_ENGINE_FAILURES = 5
_EARLY_CANCELS_KEPT = 1000
_FLUSH_RETRY_S = 0.2
_EARLY_CANCEL_TTL_S = 60.0


class Worker:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        redis: aioredis.Redis | None = None,
        model_name: str | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.model = model_name or settings.model_name or engine.card.name
        self.engine.card.name = self.model
        if settings.chat_template is not None:  # e.g. a model whose tokenizer_config lacks one
            self.engine.card.chat_template = settings.chat_template
        self.id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.keys = Keys(settings.key_prefix)
        self.redis = redis or connect(settings)
        self.scripts = Scripts.register(self.redis)
        self.queues = {p: self.keys.queue(self.model, p) for p in PRIORITIES}
        self.running: dict[str, RunningJob] = {}
        self.waiting: list[Claim] = []
        self._dirty: set[str] = set()
        self._early_cancels: dict[str, float] = {}
        self._cancel_reason: dict[str, str] = {}
        self._flush_wanted = asyncio.Event()
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._claims_since_batch = 0
        self._started_at = time.time()
        self._tokens_at_beat = (time.monotonic(), 0)
        self.tokens_per_s = 0.0
        self.runner: EngineRunner | None = None
        self.healthy = True

    # ---- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until `stop()`; then stop claiming, let running jobs finish, and leave."""
        loop = asyncio.get_running_loop()
        self.runner = EngineRunner(self.engine, loop, self._flush_wanted.set)
        await self._prepare()
        self.runner.start()
        log.info("worker started", extra={"worker_id": self.id, "model": self.model})
        tasks = [
            asyncio.create_task(self._claim_loop(), name="claim"),
            asyncio.create_task(self._flush_loop(), name="flush"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._reclaim_loop(), name="reclaim"),
            asyncio.create_task(self._control_loop(), name="control"),
        ]
        try:
            await self._stopping.wait()
            tasks[0].cancel()  # claim no more
            await self._drain(self.settings.shutdown_grace_s)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.runner.stop()
            with contextlib.suppress(RedisError, OSError):
                await self._leave()

    def stop(self) -> None:
        self._stopping.set()

    async def _prepare(self) -> None:
        for key in self.queues.values():
            with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
                await self.redis.xgroup_create(key, CONSUMER_GROUP, id="0", mkstream=True)
        card = self.engine.card
        await self.redis.hset(
            self.keys.model_card(self.model),
            mapping={"card": card.model_dump_json(), "tokenizer": self.engine.tokenizer_json},
        )
        await self.redis.sadd(self.keys.models(), self.model)
        await self._beat()

    async def _drain(self, grace_s: float) -> None:
        """Let running jobs finish for up to `grace_s`; hand the rest back for reclaim."""
        deadline = time.monotonic() + grace_s
        while self.running and time.monotonic() < deadline:
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), deadline - time.monotonic())
        for job_id in list(self.running):
            assert self.runner is not None
            self.runner.cancel(job_id)
            run = self.running.pop(job_id)
            await self._hand_back(run.claim)
        for claim in self.waiting:
            await self._hand_back(claim)
        self.waiting.clear()

    async def _hand_back(self, claim: Claim) -> None:
        """Put a held job back in the queue for any worker, now (not after the lease)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.job(claim.job_id), "status", "queued")
        pipe.hdel(self.keys.job(claim.job_id), "worker")
        pipe.xadd(claim.queue, {"job": claim.job_id, "tokens": claim.need_tokens})
        pipe.xack(claim.queue, CONSUMER_GROUP, claim.entry_id)
        pipe.xdel(claim.queue, claim.entry_id)
        await pipe.execute()

    async def _leave(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.id))
        pipe.zrem(self.keys.workers(), self.id)
        for key in self.queues.values():
            pipe.xgroup_delconsumer(key, CONSUMER_GROUP, self.id)
        await pipe.execute()

    # ---- claim ------------------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.engine.max_batch - len(self.running) - len(self.waiting)

    async def _claim_loop(self) -> None:
        while True:
            try:
                await self._start_waiting()
                free = self._free_slots()
                if free <= 0 or self.waiting:
                    self._room.clear()
                    await self._room.wait()
                    continue
                claims = await self._claim(free)
                if claims:
                    self.waiting.extend(claims)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("claim failed; retrying", extra={"error": str(exc)})
                await asyncio.sleep(0.5)

    async def _claim(self, free: int) -> list[Claim]:
        """Take up to `free` entries, interactive first; block briefly when both are empty."""
        batch_turn = self._claims_since_batch >= self.settings.batch_share
        order: tuple[Priority, ...] = ("batch", "interactive") if batch_turn else PRIORITIES
        claims: list[Claim] = []
        for priority in order:
            want = 1 if priority == "batch" and batch_turn else free - len(claims)
            if want > 0:
                claims += await self._read({self.queues[priority]: ">"}, want, block=None)
        if not claims:
            streams = {k: ">" for k in self.queues.values()}
            claims = await self._read(streams, 1, block=self.settings.claim_block_ms)
        for c in claims:
            is_batch = c.queue == self.queues["batch"]
            self._claims_since_batch = 0 if is_batch else self._claims_since_batch + 1
        return claims

    async def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[Claim]:
        reply = await self.redis.xreadgroup(
            CONSUMER_GROUP, self.id, streams, count=count, block=block  # type: ignore[arg-type]
        )
        return [
            Claim(entry_id, queue, fields["job"], int(fields.get("tokens", 0)))
            for queue, entries in _stream_items(reply)
            for entry_id, fields in entries
            if fields
        ]

    async def _start_waiting(self) -> None:
        """START every waiting claim the engine has room for, in one pipeline."""
        ready: list[Claim] = []
        active = len(self.running)
        while self.waiting and self.engine.fits(self.waiting[0].need_tokens, active + len(ready)):
            ready.append(self.waiting.pop(0))
        if not ready:
            return
        s = self.settings
        now = repr(time.time())
        pipe = self.redis.pipeline(transaction=False)
        for c in ready:
            await self.scripts.start(
                keys=self._job_keys(c.job_id),
                args=[self.id, now, s.max_attempts, s.retention_s, s.event_log_maxlen],
                client=pipe,
            )
        replies = await pipe.execute()
        sent = await self._sent_tokens(
            [c.job_id for c, r in zip(ready, replies, strict=True) if r[0] == "ok" and int(r[1]) > 1]
        )
        done_claims: list[Claim] = []
        for claim, reply in zip(ready, replies, strict=True):
            if reply[0] == "ok":
                resumed = sent.get(claim.job_id, ([], []))
                self._begin(claim, int(reply[1]), int(reply[2]), reply[3], reply[4], resumed)
            else:
                if reply[0] == "exhausted":
                    await self._dead_letter(claim, int(reply[1]))
                done_claims.append(claim)
        if done_claims:
            await self._ack(done_claims)
        self._flush_wanted.set()

    async def _sent_tokens(self, job_ids: list[str]) -> dict[str, tuple[list[int], list[str]]]:
        """For retried jobs: the token ids and text an earlier attempt already published."""
        if not job_ids:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xrange(self.keys.events(job_id))
        sent: dict[str, tuple[list[int], list[str]]] = {}
        for job_id, entries in zip(job_ids, await pipe.execute(), strict=True):
            ids: list[int] = []
            texts: list[str] = []
            for _, fields in entries:
                ev = json.loads(fields["d"])
                if ev["type"] == "token":
                    ids += ev["token_ids"]
                    texts.append(ev["text"])
            sent[job_id] = (ids, texts)
        return sent

    def _begin(
        self,
        claim: Claim,
        attempt: int,
        seq: int,
        spec_json: str,
        cancel: str,
        resumed: tuple[list[int], list[str]],
    ) -> None:
        spec = JobSpec.model_validate_json(spec_json)
        run = RunningJob(
            spec=spec,
            claim=claim,
            attempt=attempt,
            seq=seq,
            started_wall=time.time(),
            resumed_ids=resumed[0],
            text_parts=list(resumed[1]),
        )
        self.running[spec.id] = run
        self._dirty.add(spec.id)
        run.started(self.id)
        if cancel or spec.id in self._early_cancels:
            self._early_cancels.pop(spec.id, None)
            run.cancelled(cancel or "cancelled")
            return
        if spec.deadline is not None and time.time() > spec.deadline:
            run.fail("expired", "deadline_exceeded", "the job's timeout passed before it started")
            return
        seed = spec.sampling.seed if spec.sampling.seed is not None else _seed_of(spec.id)
        assert self.runner is not None
        self.runner.add(
            EngineJob(
                id=spec.id,
                input_ids=spec.input_ids,
                max_tokens=spec.max_tokens,
                sampling=spec.sampling,
                seed=seed,
                resume_ids=resumed[0],
            )
        )

    async def _dead_letter(self, claim: Claim, attempts: int) -> None:
        entry = {"job": claim.job_id, "attempts": attempts, "at": repr(time.time())}
        await self.redis.xadd(self.keys.dead_letters(), entry, maxlen=100_000, approximate=True)
        log.warning("job dead-lettered", extra={"job_id": claim.job_id, "attempts": attempts})

    async def _ack(self, claims: list[Claim]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for c in claims:
            pipe.xack(c.queue, CONSUMER_GROUP, c.entry_id)
            pipe.xdel(c.queue, c.entry_id)
        await pipe.execute()

    # ---- flush ------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            assert self.runner is not None
            self._collect(self.runner.drain())
            if not self._dirty:
                continue
            await self._flush()

    def _collect(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            run = self.running.get(out.job_id)
            if run is None or run.end is not None:
                continue
            if out.token_ids or out.text:
                run.add_tokens(out.text, out.token_ids, out.logprobs)
            if out.prompt_tokens:
                run.prompt_tokens = out.prompt_tokens
                run.cached_tokens = out.cached_tokens
            if out.error is not None:
                run.fail("failed", "engine_error", out.error)
            elif out.finish_reason == "cancelled":
                run.cancelled(self._cancel_reason.pop(run.id, "cancelled"))
            elif out.finish_reason is not None:
                run.finish(out.finish_reason)
            self._dirty.add(out.job_id)
        if self.runner is not None and self.runner.failures >= _MAX_ENGINE_FAILURES:
            log.error("engine keeps failing; stopping", extra={"worker_id": self.id})
            self.healthy = False
            self.stop()

    async def _flush(self) -> None:
        """One pipeline: every dirty job's pending events (EMIT), or its end (FINISH)."""
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        order: list[tuple[RunningJob, list[str]]] = []
        for job_id in self._dirty:
            run = self.running.get(job_id)
            if run is None:
                continue
            events = run.take_events()
            head = [self.id, str(run.attempt), str(s.event_log_maxlen)]
            if run.end is not None:
                status, fields = run.end
                record = [x for kv in fields.items() for x in kv]
                args = [*head, str(s.retention_s), str(len(events) // 2), *events]
                await self.scripts.finish(
                    keys=self._job_keys(job_id), args=[*args, "status", status, *record], client=pipe
                )
            elif events:
                await self.scripts.emit(keys=self._job_keys(job_id), args=head + events, client=pipe)
            else:
                continue
            order.append((run, events))
        self._dirty.clear()
        if not order:
            return
        try:
            results = await pipe.execute()
        except (RedisError, OSError) as exc:
            # Nothing is lost: the events go again (the scripts skip seqs already written).
            log.warning("flush failed; retrying", extra={"error": str(exc)})
            for run, events in order:
                run.pending[:0] = events
                self._dirty.add(run.id)
            await asyncio.sleep(_FLUSH_RETRY_S)
            self._flush_wanted.set()
            return
        ended: list[Claim] = []
        for (run, _), ok in zip(order, results, strict=True):
            if not ok:  # fenced: another worker owns this job now
                log.warning("lost ownership; dropping job", extra={"job_id": run.id})
                assert self.runner is not None
                self.runner.cancel(run.id)
                self.running.pop(run.id, None)
                self._room.set()
            elif run.end is not None:
                self.running.pop(run.id, None)
                ended.append(run.claim)
        if ended:
            await self._ack(ended)
            self._room.set()

    def _job_keys(self, job_id: str) -> list[str]:
        k = self.keys
        return [k.job(job_id), k.events(job_id), k.channel(job_id)]

    # ---- cancel -----------------------------------------------------------------------

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        run = self.running.get(job_id)
        if run is None:  # a cancel can overtake the START reply that tells us of the job
            now = time.monotonic()
            if len(self._early_cancels) > _EARLY_CANCELS_KEPT:
                self._early_cancels = {
                    k: t for k, t in self._early_cancels.items() if now - t < _EARLY_CANCEL_TTL_S
                }
            self._early_cancels[job_id] = now
            return
        self._cancel_reason[job_id] = reason
        assert self.runner is not None
        self.runner.cancel(job_id)

    async def _control_loop(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.control(self.id))
                while True:
                    msg = await pubsub.get_message(timeout=5.0)
                    if msg is not None:
                        self.cancel(ControlMessage.model_validate_json(msg["data"]).cancel)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, ValueError) as exc:
                log.warning("control channel failed; resubscribing", extra={"error": str(exc)})
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # ---- heartbeat and reclaim -------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self._beat()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed", extra={"error": str(exc)})

    async def _beat(self) -> None:
        now_m = time.monotonic()
        tokens = self.runner.tokens if self.runner else 0
        t0, n0 = self._tokens_at_beat
        if now_m > t0:
            self.tokens_per_s = (tokens - n0) / (now_m - t0)
        self._tokens_at_beat = (now_m, tokens)
        hb = Heartbeat(
            worker_id=self.id,
            model=self.model,
            engine=self.engine.card.engine,
            gpu=os.environ.get("CUDA_VISIBLE_DEVICES"),
            host=socket.gethostname(),
            pid=os.getpid(),
            version=__version__,
            capacity=self.engine.max_batch,
            active=len(self.running),
            tokens_per_s=round(self.tokens_per_s, 1),
            started_at=self._started_at,
            draining=self._stopping.is_set(),
        )
        lease_ms = int(self.settings.lease_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        key = self.keys.worker(self.id)
        pipe.hset(key, mapping={k: json.dumps(v) for k, v in hb.model_dump().items()})
        pipe.pexpire(key, lease_ms)
        pipe.zadd(self.keys.workers(), {self.id: time.time() + self.settings.lease_s})
        pipe.sadd(self.keys.models(), self.model)
        held: dict[str, list[str]] = {}
        for c in [r.claim for r in self.running.values()] + self.waiting:
            held.setdefault(c.queue, []).append(c.entry_id)
        for queue, ids in held.items():  # reset idle time: these entries have a live owner
            pipe.xclaim(queue, CONSUMER_GROUP, self.id, 0, ids, justid=True)
        await pipe.execute()

    async def _reclaim_loop(self) -> None:
        """Take over entries whose owner stopped touching them for a whole lease."""
        idle_ms = int(self.settings.lease_s * 1000)
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            if self._free_slots() <= 0 or self._stopping.is_set():
                continue
            try:
                for queue in self.queues.values():
                    reply = await self.redis.xautoclaim(
                        queue, CONSUMER_GROUP, self.id, idle_ms, "0-0", count=self._free_slots()
                    )
                    for entry_id, fields in reply[1]:
                        if fields:
                            claim = Claim(entry_id, queue, fields["job"], int(fields.get("tokens", 0)))
                            log.info("reclaimed job", extra={"job_id": claim.job_id})
                            self.waiting.append(claim)
                    self._room.set()
            except (RedisError, OSError) as exc:
                log.warning("reclaim failed", extra={"error": str(exc)})


def _stream_items(reply: Any) -> list[tuple[str, list[tuple[str, dict[str, str]]]]]:
    """XREADGROUP's reply as (stream, entries) pairs, for RESP2 lists and RESP3 maps."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in reply.items()]
    return [(stream, entries) for stream, entries in reply]


def _seed_of(job_id: str) -> int:
    """A job without a seed samples from one fixed per job, so a retry continues the same text."""
    return int(job_id[:16], 16) if len(job_id) >= 16 else abs(hash(job_id))
