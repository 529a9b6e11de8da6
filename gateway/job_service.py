"""Job operations behind the routes: submit, look up, cancel. Errors are raised as GenqError."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import redis.asyncio as aioredis

from gateway import access_log, rate_headers
from gateway.admission import AdmissionControl, job_cost
from gateway.constraints import ConstraintChecker, check_compatible
from gateway.identity import Identity
from gateway.placement import Placement
from gateway.registry import LoadedCard, ModelRegistry
from gateway.webhooks import check_job_webhook, notify_for
from shared import events
from shared.compact import CompactLog
from shared.deadlines import expire_due
from shared.errors import BadRequest, Conflict, JobNotFound, PromptTooLong, Unprocessable, shown
from shared.events import EVENT_FIELD, CancelledEvent, EventError, QueuedEvent, TokenEvent
from shared.keys import seq_of
from shared.records import JOB_ID, ControlMessage, IdempotencyClaim, JobRecord, QueueEntry
from shared.schemas import MAX_METADATA_DEPTH, JobCreate, JobSpec, JobView, Sampling, json_depth
from shared.settings import GatewaySettings
from shared.transitions import (
    Call,
    CancelEnded,
    CancelQueued,
    CancelRunning,
    Limited,
    Queued,
    ScriptRunner,
    SubmitReply,
    Throttled,
    Transitions,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"
"""An Idempotency-Key: 1 to 255 visible ASCII characters (documented in the API)."""
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
_SUBMIT_TRIES = 3
"""An idempotency key whose job expired is freed and claimed again; past this, a 409."""
_CANCEL_TRIES = 3
"""A queued job a worker starts while it is being cancelled is cancelled as a running one."""


@dataclass(frozen=True, slots=True)
class Submission:
    call: Call[SubmitReply]
    record: JobRecord


@dataclass(slots=True)
class Submitted:
    job: JobView
    replayed: bool
    """True when an Idempotency-Key matched an earlier submission."""


INLINE_CHARS = 512
"""Prompts up to this many characters are tokenized on the event loop: ~0.1 ms of it (33 µs
for 130 characters with the sim's byte-level BPE) against ~0.13 ms of CPU for the hop to a
thread and back (measured on the 2-core dev box)."""


class JobService:
    def __init__(
        self,
        settings: GatewaySettings,
        redis: aioredis.Redis,
        scripts: ScriptRunner,
        registry: ModelRegistry,
    ) -> None:
        self.settings = settings
        self._cpu = anyio.CapacityLimiter(settings.prepare_threads)
        self.redis = redis
        self.scripts = scripts
        self.registry = registry
        self.keys = settings.keys()
        self.transitions = Transitions(
            self.keys, settings.recent_jobs, settings.event_compact_grace_s
        )
        self.admission = AdmissionControl(settings, redis, scripts, self.keys)
        self.placement = Placement(settings, redis, self.keys, registry.live_workers)
        self.constraints = ConstraintChecker(settings)
        self._short_of_replicas = False
        """The last submit was answered with fewer replicas than GENQ_REDIS_WAIT_REPLICAS."""

    def validate_id(self, job_id: str) -> str:
        if not JOB_ID.fullmatch(job_id):
            raise job_not_found(job_id)
        access_log.touched_job(job_id)
        return job_id

    async def prepare(self, body: JobCreate) -> JobSpec:
        """Validate against the model's card and tokenize; nothing is written yet. The cheap
        checks (sizes, counts) come first; tokenizing runs off the event loop."""
        self._check_metadata(body.metadata)
        if body.webhook is not None:
            check_job_webhook(self.settings, body.webhook)
        loaded = await self.registry.get(body.model)
        card = loaded.card
        if body.prompt is not None:
            ids = await self._tokenize(loaded, body.prompt)
        else:
            assert body.input_ids is not None
            ids = body.input_ids
            _check_vocab(loaded, ids, "input_ids")
        _check_vocab(loaded, body.stop_token_ids, "stop_token_ids")
        _check_vocab(loaded, [int(k) for k in body.logit_bias], "logit_bias")
        max_tokens = self._max_tokens(body.max_tokens, len(ids), card.max_seq_len)
        _check_min_tokens(body.min_tokens, max_tokens, defaulted=body.max_tokens is None)
        constraint = None
        given = body.constraint()
        if given is not None:
            kind, value = given
            check_compatible(Sampling.of(body), kind)
            strict = body.json_schema_strict is not False  # the native default: strict
            constraint = await self.constraints.check(
                loaded, kind, value, kind, self.off_loop, strict=strict
            )
        now = time.time()
        return JobSpec(
            id=uuid.uuid4().hex,
            model=card.name,
            input_ids=ids,
            max_tokens=max_tokens,
            sampling=Sampling.of(body),
            priority=body.priority,
            created_at=now,
            deadline=now + body.timeout_s if body.timeout_s else None,
            constraint=constraint,
            followed=body.stream,
        )

    async def off_loop(self, work: Callable[[], T], size: int | None = None) -> T:
        """`work` (CPU-bound: tokenizing, rendering a chat template) in a worker thread, at
        most `prepare_threads` at once, so the event loop keeps serving every other request.
        Work of `size` up to `INLINE_CHARS` characters runs here instead: it takes the loop
        for less than the hop to a thread and back would cost."""
        if size is not None and size <= INLINE_CHARS:
            return work()
        return await anyio.to_thread.run_sync(work, limiter=self._cpu)

    async def _tokenize(self, loaded: LoadedCard, prompt: str) -> list[int]:
        limit = self.settings.max_prompt_chars
        if len(prompt) > limit:
            raise BadRequest(
                f"prompt is {len(prompt)} characters; the limit (GENQ_MAX_PROMPT_CHARS) is {limit}",
                param="prompt",
            )
        tokenizer, card = loaded.tokenizer, loaded.card

        def encode() -> list[int]:
            # encode_batch lets go of the GIL while it works (encode holds it throughout)
            return list(tokenizer.encode_batch([prompt], add_special_tokens=False)[0].ids)

        ids = await self.off_loop(encode, len(prompt))
        if card.add_bos and card.bos_token is not None:
            bos = tokenizer.token_to_id(card.bos_token)
            if bos is not None:
                ids = [bos, *ids]
        if not ids:
            raise BadRequest("prompt is empty after tokenization", param="prompt")
        return ids

    def _max_tokens(self, asked: int | None, prompt_tokens: int, context: int) -> int:
        """`asked`, or what the context leaves (at most GENQ_DEFAULT_MAX_TOKENS)."""
        room = context - prompt_tokens
        if room < 1:
            raise no_room(prompt_tokens, context)
        if asked is None:
            return min(self.settings.default_max_tokens, room)
        if asked > room:
            raise PromptTooLong(
                f"prompt is {prompt_tokens} tokens and max_tokens is {asked}: "
                f"{prompt_tokens + asked} in all, over the model's maximum context length of "
                f"{context} tokens",
                param="max_tokens",
            )
        return asked

    def _check_metadata(self, metadata: dict[str, Any]) -> None:
        limit = self.settings.max_metadata_bytes
        try:
            size = len(json.dumps(metadata))
        except RecursionError:
            size = limit + 1  # only a body nested too deeply to serialise gets here
        if size > limit:
            raise BadRequest(
                f"metadata is over {limit} bytes of JSON (GENQ_MAX_METADATA_BYTES)",
                param="metadata",
            )
        depth = json_depth(metadata)
        if depth > MAX_METADATA_DEPTH:
            raise BadRequest(
                f"metadata nests {depth} levels deep; the limit is {MAX_METADATA_DEPTH}",
                param="metadata",
            )

    async def submit(
        self,
        body: JobCreate,
        idempotency_key: str | None = None,
        spec: JobSpec | None = None,
        *,
        caller: Identity,
        part: int = 0,
        fingerprint: str | None = None,
        charge: int | None = None,
    ) -> Submitted:
        """Queue a job for `caller` in one atomic step (idempotency key, admission, record,
        first event, queue entry, its tokens charged to the caller's tokens per minute); with
        an Idempotency-Key the caller already used, the earlier job (or a 422 for another
        body), charged nothing. `part` and `fingerprint`: for a request that makes several
        jobs under one key (the fingerprint then is the request's). `charge`: the tokens to
        charge (a request of several jobs charges them all with its first); None: the job's."""
        spec = spec or await self.prepare(body)
        idem = None
        if idempotency_key is not None:
            idem = self.keys.idempotency(caller.owner, check_idempotency_key(idempotency_key), part)
        charge = job_cost(spec) if charge is None else charge
        await self.placement.met()
        submission = self.submission(
            body, spec, idem, caller=caller, fingerprint=fingerprint, charge=charge
        )
        for _ in range(_SUBMIT_TRIES):
            reply = await self._run_replicated(submission.call)
            if isinstance(reply, Queued):
                rate_headers.note(tokens=reply.tokens)
                _log_queued(submission.record, caller)
                return Submitted(submission.record.view(), replayed=False)
            if isinstance(reply, Limited):
                raise self.admission.refusal(caller, spec, reply)
            if isinstance(reply, Throttled):
                rate_headers.note(tokens=reply.tokens)
                raise self.admission.throttled(caller, charge, reply)
            assert idem is not None
            earlier = await self._earlier(idem, reply.claim, submission.record.fingerprint or "")
            if earlier is not None:
                access_log.touched_job(earlier.id)
                return Submitted(earlier, replayed=True)
        raise Conflict(
            "Idempotency-Key is being claimed concurrently; retry", param="Idempotency-Key"
        )

    async def _run_replicated(self, call: Call[SubmitReply]) -> SubmitReply:
        """`call`, held by GENQ_REDIS_WAIT_REPLICAS replicas before it is answered: a write
        only the master holds is lost if it fails over now (README, "Redis Sentinel")."""
        want = self.settings.wait_replicas
        reply, acked = await self.scripts.run_replicated(
            call, want, self.settings.redis_wait_timeout_ms
        )
        short = acked < want
        if short != self._short_of_replicas:  # one line per change, not one per submit
            self._short_of_replicas = short
            if short:
                log.warning(
                    "submits answered before enough replicas hold them (each waits "
                    "GENQ_REDIS_WAIT_TIMEOUT_MS); a failover now can lose them",
                    extra={"replicas": acked, "wanted": want},
                )
            else:
                log.info("submits held by enough replicas again", extra={"replicas": acked})
        return reply

    def submission(
        self,
        body: JobCreate,
        spec: JobSpec,
        idempotency: str | None,
        *,
        caller: Identity,
        fingerprint: str | None = None,
        idempotency_ttl_s: int | None = None,
        done_stream: str | None = None,
        charge: int = 0,
    ) -> Submission:
        """The SUBMIT call of a prepared job for `caller`, claiming the Redis key
        `idempotency` (if any), charging `charge` tokens to the caller's tokens per minute
        (none for a batch's jobs: as OpenAI's, outside the live limits); nothing is written
        until it runs. Callers that queue many jobs pipeline these."""
        fingerprint = fingerprint or _fingerprint(body)
        kind = "response" if body.metadata.get("api") == "openai.response" else "job"
        notify = done_stream is None and notify_for(self.settings, kind, body.webhook)
        record = JobRecord(
            spec=spec,
            status="queued",
            metadata=body.metadata,
            fingerprint=fingerprint,
            owner=caller.owner,
            webhook=body.webhook,
            notify=self.keys.webhook_outbox() if notify else None,
            done_stream=done_stream,
        )
        prompt_tokens = len(spec.input_ids)
        queued = QueuedEvent(
            seq=1, id=spec.id, model=spec.model, priority=spec.priority, prompt_tokens=prompt_tokens
        )
        meta = body.metadata
        conversation = meta.get("prompt_cache_key") or meta.get("user")
        placed = self.placement.decide(
            spec, conversation if isinstance(conversation, str) else None
        )
        admission = self.admission.admission(
            caller, spec, charge, self.placement.cached_tokens(spec)
        )
        entry = QueueEntry(
            job=spec.id, tokens=admission.tokens, owner=caller.owner, wait_ms=placed.wait_ms
        )
        call = self.transitions.submit(
            record,
            queued_event=events.encode(queued),
            entry=entry,
            idempotency_key=idempotency,
            idempotency_claim=IdempotencyClaim(job=spec.id, fingerprint=fingerprint).encode(),
            idempotency_ttl_s=idempotency_ttl_s or self.settings.idempotency_ttl_s,
            admission=admission,
            lane=placed.lane,
            news=placed.news,
        )
        return Submission(call, record)

    async def _earlier(self, idem: str, claim_text: str, fingerprint: str) -> JobView | None:
        """The job an idempotency key names; None once the key is freed (its job expired)."""
        claim = IdempotencyClaim.decode(claim_text)
        if claim.fingerprint != fingerprint:
            raise Unprocessable(
                "Idempotency-Key was already used with a different request body",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        raw = await self.redis.hgetall(self.keys.job(claim.job))
        if raw.get("status") == "abandoned":  # cluster: its submit was given up, never answered
            raw = {}
        if raw:
            return JobRecord.from_hash(raw).view()
        if self.keys.cluster and await self._still_submitting(claim.job):
            return None  # its submit is under way (or stopped: the reconciler settles it)
        await self.scripts.run(self.transitions.release_idempotency(idem, claim=claim_text))
        return None

    async def _still_submitting(self, job_id: str) -> bool:
        """Cluster: the job's entry is pending in its shard (its submit claimed the key and has
        not written the record yet, or stopped there): the claim is not to be freed."""
        k = self.keys
        return bool(await self.redis.hexists(k.pending(k.shard_of(job_id)), job_id))

    async def get(self, job_id: str, caller: Identity, *, text_so_far: bool = True) -> JobView:
        """The job as its record holds it; a job that has run but has no result (running, or
        back in the queue) shows the text so far, read from its event log (`text_so_far`); a
        job past its deadline reads `expired` at once."""
        record = await self._record(job_id, caller)
        if _overdue(record):
            record = await self._expire(record)
        if record.status == "succeeded" and record.worker is not None:
            self.placement.ended(job_id, record.worker)  # a poll's follow-up finds it
        view = record.view()
        if text_so_far and record.result is None and record.attempt > 0:
            if record.log is not None:  # its log was compacted: the text is there
                view.text, view.text_truncated = self._compacted_text(record.log)
            else:
                view.text, view.text_truncated = await self._text_so_far(job_id)
        return view

    def _compacted_text(self, value: str) -> tuple[str, bool]:
        """`_text_so_far` of a compacted log (`shared.compact`, which holds the text of a job
        without a result)."""
        cap = self.settings.partial_text_max_chars
        text = CompactLog.decode(value).full_text(None)
        return text[:cap], len(text) > cap

    async def _text_so_far(self, job_id: str) -> tuple[str, bool]:
        """The token texts of the job's log, a page at a time, up to `partial_text_max_chars`;
        and whether that is less than all of it (the cap, or a log that lost its start)."""
        page, cap = self.settings.event_page_entries, self.settings.partial_text_max_chars
        key = self.keys.events(job_id)
        parts: list[str] = []
        chars, start, expected, lost = 0, "-", 1, False
        while True:
            entries = await self.redis.xrange(key, start, "+", count=page)
            for entry_id, fields in entries:
                seq = seq_of(entry_id)
                lost, expected = lost or seq != expected, seq + 1
                try:
                    ev = events.decode(fields[EVENT_FIELD])
                except (EventError, KeyError):  # a damaged entry: the rest still reads
                    continue
                if isinstance(ev, TokenEvent):
                    parts.append(ev.text)
                    chars += len(ev.text)
                    if chars > cap:
                        return "".join(parts)[:cap], True
            if len(entries) < page:
                return "".join(parts), lost
            start = f"({entries[-1][0]}"

    async def _expire(self, record: JobRecord) -> JobRecord:
        """A job past its deadline ends `expired` as soon as anyone looks: here and now if
        nobody else will end it (queued, or its worker gone); else its worker is told to
        stop it now (it writes the end at its next step) rather than at its next heartbeat."""
        job_id = record.spec.id
        await expire_due(self.redis, self.scripts, self.keys, self.settings, 1, [job_id])
        raw = await self.redis.hgetall(self.keys.job(job_id))
        if not raw:
            return record
        record = JobRecord.from_hash(raw)
        if record.status == "running" and record.worker:
            msg = ControlMessage(cancel=job_id, attempt=record.attempt, expire=True)
            await self.redis.publish(self.keys.control(record.worker), msg.encode())
        return record

    async def _record(self, job_id: str, caller: Identity) -> JobRecord:
        """The job's record; 404 for a job the caller may not see, as for one that is not."""
        raw = await self.redis.hgetall(self.keys.job(self.validate_id(job_id)))
        record = JobRecord.from_hash(raw) if raw else None
        if record is None or not caller.may_see(record):
            raise job_not_found(job_id)
        return record

    async def cancel(self, job_id: str, caller: Identity, reason: str = "cancelled") -> JobView:
        """Cancel a queued job at once, or ask the worker running it to stop."""
        await self._check_visible(job_id, caller)
        for _ in range(_CANCEL_TRIES):
            reply = await self.scripts.run(self.transitions.request_cancel(job_id, reason=reason))
            if isinstance(reply, CancelRunning):
                msg = ControlMessage(cancel=job_id, attempt=reply.attempt, reason=reason)
                await self.redis.publish(self.keys.control(reply.worker), msg.encode())
                return await self.get(job_id, caller, text_so_far=False)  # it is about to end
            if isinstance(reply, CancelEnded):
                if reply.status == "missing":
                    raise job_not_found(job_id)
                raise Conflict(f"job '{job_id}' already ended: {reply.status}", param="id")
            if await self._cancel_queued(job_id, reply, reason):
                return await self.get(job_id, caller)
        raise Conflict(f"job '{job_id}' changed while cancelling it; retry", param="id")

    async def _check_visible(self, job_id: str, caller: Identity) -> None:
        """404 for a job the caller may not see (`Identity.may_see`, the one rule)."""
        await self._record(job_id, caller)

    async def _cancel_queued(self, job_id: str, seen: CancelQueued, reason: str) -> bool:
        """End a queued job `cancelled`, unless a worker took it meanwhile."""
        cancelled = await self.scripts.run(self._settle_cancelled(job_id, seen, reason))
        if cancelled:
            fields = {"job_id": job_id, "status": "queued", "reason": reason}
            log.info("job cancelled", extra=fields)
        return cancelled

    def _settle_cancelled(self, job_id: str, seen: CancelQueued, reason: str) -> Call[bool]:
        s = self.settings
        seq = seen.last_seq + 1
        event = CancelledEvent(seq=seq, attempt=seen.attempt, reason=reason)
        return self.transitions.settle(
            job_id,
            status="queued",
            attempt=seen.attempt,
            last_seq=seen.last_seq,
            event=(seq, events.encode(event)),
            fields=JobRecord.fields(status="cancelled", finished_at=time.time()),
            maxlen=s.event_log_maxlen,
            retention_s=s.retention_s,
        )

    async def cancel_many(self, job_ids: Sequence[str], reason: str) -> None:
        """Cancel many jobs in a few pipelines (a batch's): queued ones end at once, running
        ones are told to stop, ended or missing ones are left alone. Best effort, as `cancel`
        tries again: a queued job that a worker starts meanwhile is asked to stop once more."""
        pending = list(job_ids)
        for _ in range(_CANCEL_TRIES):
            if not pending:
                return
            calls = [self.transitions.request_cancel(j, reason=reason) for j in pending]
            replies = await self.scripts.run_all(calls)
            pipe = self.redis.pipeline(transaction=False)
            queued: list[tuple[str, CancelQueued]] = []
            for job_id, reply in zip(pending, replies, strict=True):
                if isinstance(reply, CancelRunning):
                    msg = ControlMessage(cancel=job_id, attempt=reply.attempt, reason=reason)
                    pipe.publish(self.keys.control(reply.worker), msg.encode())
                elif isinstance(reply, CancelQueued):
                    queued.append((job_id, reply))
            await pipe.execute()
            settles = [self._settle_cancelled(j, seen, reason) for j, seen in queued]
            settled = await self.scripts.run_all(settles)
            pending = [j for (j, _), ok in zip(queued, settled, strict=True) if ok is not True]


def _log_queued(record: JobRecord, caller: Identity) -> None:
    """The job's first step; its size, never its prompt."""
    spec = record.spec
    fields: dict[str, object] = {
        "job_id": spec.id,
        "model": spec.model,
        "priority": spec.priority,
        "prompt_tokens": len(spec.input_ids),
        "max_tokens": spec.max_tokens,
    }
    if caller.keyed:
        fields["owner"] = caller.owner
    log.debug("job queued", extra=fields)  # a healthy job's one info line is the worker's end
    access_log.touched_job(spec.id)


def job_not_found(job_id: str) -> JobNotFound:
    """The 404 of a job the caller may not see: the same for a malformed id, an unknown one,
    an expired one and another owner's, so that none tells anything about the others."""
    return JobNotFound(f"no job {shown(job_id)} (unknown, or expired)", param="id")


def _overdue(record: JobRecord) -> bool:
    deadline = record.spec.deadline
    live = record.status in ("queued", "running")
    return live and deadline is not None and time.time() > deadline


def check_idempotency_key(key: str) -> str:
    if not _IDEMPOTENCY_KEY.fullmatch(key):
        raise BadRequest(
            "Idempotency-Key must be 1 to 255 visible ASCII characters", param="Idempotency-Key"
        )
    return key


def no_room(prompt_tokens: int, context: int) -> PromptTooLong:
    """The 400 of a prompt that leaves its model no room to generate."""
    return PromptTooLong(
        f"prompt is {prompt_tokens} tokens, the model's maximum context length is "
        f"{context} tokens: no room is left to generate",
        param="prompt",
    )


def _check_vocab(loaded: LoadedCard, ids: list[int], param: str) -> None:
    vocab = loaded.tokenizer.get_vocab_size(with_added_tokens=True)
    bad = next((i for i in ids if i >= vocab), None)
    if bad is not None:
        raise BadRequest(
            f"{param} holds {bad}, outside the model's vocabulary of {vocab}", param=param
        )


def _check_min_tokens(min_tokens: int, max_tokens: int, *, defaulted: bool) -> None:
    """400 for a job that must generate more tokens than it may."""
    if min_tokens > max_tokens:
        why = " (max_tokens not given: what the context leaves, at most GENQ_DEFAULT_MAX_TOKENS)"
        raise BadRequest(
            f"min_tokens is {min_tokens}, over the job's max_tokens of {max_tokens}"
            + (why if defaulted else ""),
            param="min_tokens",
        )


def _fingerprint(body: JobCreate) -> str:
    canonical = body.model_dump_json(exclude={"stream"})
    return hashlib.sha256(canonical.encode()).hexdigest()
