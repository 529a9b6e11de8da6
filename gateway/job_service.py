"""Job operations behind the routes: submit, look up, cancel. Errors are raised as GenqError."""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.registry import ModelRegistry
from shared import events
from shared.errors import BadRequest, Conflict, JobNotFound, PromptTooLong, Unprocessable
from shared.events import CancelledEvent, QueuedEvent
from shared.keys import Keys
from shared.records import JOB_ID, ControlMessage, IdempotencyClaim, JobRecord, QueueEntry
from shared.schemas import JobCreate, JobSpec, JobView
from shared.settings import GatewaySettings
from shared.transitions import (
    Call,
    CancelEnded,
    CancelQueued,
    CancelRunning,
    Queued,
    ScriptRunner,
    SubmitReply,
    Transitions,
)

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


class JobService:
    def __init__(
        self,
        settings: GatewaySettings,
        redis: aioredis.Redis,
        scripts: ScriptRunner,
        registry: ModelRegistry,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.scripts = scripts
        self.registry = registry
        self.keys = Keys(settings.key_prefix)
        self.transitions = Transitions(self.keys)

    def validate_id(self, job_id: str) -> str:
        if not JOB_ID.fullmatch(job_id):
            raise JobNotFound(f"no job '{job_id[:64]}'", param="id")
        return job_id

    async def prepare(self, body: JobCreate) -> JobSpec:
        """Validate against the model's card and tokenize; nothing is written yet."""
        loaded = await self.registry.get(body.model)
        card = loaded.card
        if body.prompt is not None:
            if len(body.prompt) > self.settings.max_prompt_chars:
                raise BadRequest(
                    f"prompt is {len(body.prompt)} characters; the limit is "
                    f"{self.settings.max_prompt_chars}",
                    param="prompt",
                )
            ids = loaded.tokenizer.encode(body.prompt, add_special_tokens=False).ids
            if card.add_bos and card.bos_token is not None:
                bos = loaded.tokenizer.token_to_id(card.bos_token)
                if bos is not None:
                    ids = [bos, *ids]
            if not ids:
                raise BadRequest("prompt is empty after tokenization", param="prompt")
        else:
            assert body.input_ids is not None
            ids = body.input_ids
            vocab = loaded.tokenizer.get_vocab_size(with_added_tokens=True)
            bad = next((i for i in ids if i >= vocab), None)
            if bad is not None:
                raise BadRequest(
                    f"input_ids holds {bad}, outside the model's vocabulary of {vocab}",
                    param="input_ids",
                )
        room = card.max_seq_len - len(ids)
        max_tokens = body.max_tokens or min(self.settings.default_max_tokens, room)
        if room < 1 or len(ids) + max_tokens > card.max_seq_len:
            raise PromptTooLong(
                f"prompt is {len(ids)} tokens and max_tokens is {max_tokens}: "
                f"{len(ids) + max_tokens} in all, over the model's maximum context length of "
                f"{card.max_seq_len} tokens",
                param="max_tokens" if room >= 1 else "prompt",
            )
        if len(json.dumps(body.metadata)) > self.settings.max_metadata_bytes:
            raise BadRequest(
                f"metadata is over {self.settings.max_metadata_bytes} bytes of JSON",
                param="metadata",
            )
        now = time.time()
        return JobSpec(
            id=uuid.uuid4().hex,
            model=card.name,
            input_ids=ids,
            max_tokens=max_tokens,
            sampling=body.model_dump(include=_SAMPLING_FIELDS),  # type: ignore[arg-type]
            priority=body.priority,
            created_at=now,
            deadline=now + body.timeout_s if body.timeout_s else None,
        )

    async def submit(
        self, body: JobCreate, idempotency_key: str | None = None, spec: JobSpec | None = None
    ) -> Submitted:
        """Queue a job in one atomic step (idempotency key, record, first event, queue entry);
        with an Idempotency-Key already used, the earlier job (or a 422 for another body)."""
        spec = spec or await self.prepare(body)
        idem = None
        if idempotency_key is not None:
            if not _IDEMPOTENCY_KEY.fullmatch(idempotency_key):
                raise BadRequest(
                    "Idempotency-Key must be 1 to 255 visible ASCII characters",
                    param="Idempotency-Key",
                )
            idem = self.keys.idempotency(idempotency_key)
        submission = self.submission(body, spec, idem)
        for _ in range(_SUBMIT_TRIES):
            reply = await self.scripts.run(submission.call)
            if isinstance(reply, Queued):
                return Submitted(submission.record.view(), replayed=False)
            assert idem is not None
            earlier = await self._earlier(idem, reply.claim, submission.record.fingerprint or "")
            if earlier is not None:
                return Submitted(earlier, replayed=True)
        raise Conflict(
            "Idempotency-Key is being claimed concurrently; retry", param="Idempotency-Key"
        )

    def submission(
        self,
        body: JobCreate,
        spec: JobSpec,
        idempotency: str | None,
        *,
        idempotency_ttl_s: int | None = None,
        done_stream: str | None = None,
    ) -> Submission:
        """The SUBMIT call of a prepared job, claiming the Redis key `idempotency` (if any);
        nothing is written until it runs. Callers that queue many jobs pipeline these."""
        fingerprint = _fingerprint(body)
        record = JobRecord(
            spec=spec,
            status="queued",
            metadata=body.metadata,
            fingerprint=fingerprint,
            done_stream=done_stream,
        )
        prompt_tokens = len(spec.input_ids)
        queued = QueuedEvent(
            seq=1, id=spec.id, model=spec.model, priority=spec.priority, prompt_tokens=prompt_tokens
        )
        call = self.transitions.submit(
            record,
            queued_event=events.encode(queued),
            entry=QueueEntry(job=spec.id, tokens=prompt_tokens + spec.max_tokens),
            idempotency_key=idempotency,
            idempotency_claim=IdempotencyClaim(job=spec.id, fingerprint=fingerprint).encode(),
            idempotency_ttl_s=idempotency_ttl_s or self.settings.idempotency_ttl_s,
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
        if raw:
            return JobRecord.from_hash(raw).view()
        await self.scripts.run(self.transitions.release_idempotency(idem, claim=claim_text))
        return None

    async def get(self, job_id: str) -> JobView:
        return (await self._record(job_id)).view()

    async def _record(self, job_id: str) -> JobRecord:
        raw = await self.redis.hgetall(self.keys.job(self.validate_id(job_id)))
        if not raw:
            raise JobNotFound(f"no job '{job_id}' (unknown, or expired)", param="id")
        return JobRecord.from_hash(raw)

    async def cancel(self, job_id: str, reason: str = "cancelled") -> JobView:
        """Cancel a queued job at once, or ask the worker running it to stop."""
        self.validate_id(job_id)
        for _ in range(_CANCEL_TRIES):
            reply = await self.scripts.run(self.transitions.request_cancel(job_id, reason=reason))
            if isinstance(reply, CancelRunning):
                msg = ControlMessage(cancel=job_id, attempt=reply.attempt, reason=reason)
                await self.redis.publish(self.keys.control(reply.worker), msg.encode())
                return await self.get(job_id)
            if isinstance(reply, CancelEnded):
                if reply.status == "missing":
                    raise JobNotFound(f"no job '{job_id}' (unknown, or expired)", param="id")
                raise Conflict(f"job '{job_id}' already ended: {reply.status}", param="id")
            if await self._cancel_queued(job_id, reply, reason):
                return await self.get(job_id)
        raise Conflict(f"job '{job_id}' changed while cancelling it; retry", param="id")

    async def _cancel_queued(self, job_id: str, seen: CancelQueued, reason: str) -> bool:
        """End a queued job `cancelled`, unless a worker took it meanwhile."""
        return await self.scripts.run(self._settle_cancelled(job_id, seen, reason))

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


_SAMPLING_FIELDS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
}


def _fingerprint(body: JobCreate) -> str:
    canonical = body.model_dump_json(exclude={"stream"})
    return hashlib.sha256(canonical.encode()).hexdigest()
