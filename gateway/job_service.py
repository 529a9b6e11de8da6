"""Job operations behind the routes: submit, look up, cancel. Errors are raised as GenqError."""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway.registry import ModelRegistry
from shared.errors import BadRequest, Conflict, JobNotFound, PromptTooLong, Unprocessable
from shared.keys import Keys, event_id
from shared.schemas import (
    TERMINAL_STATUSES,
    ErrorInfo,
    JobCreate,
    JobResult,
    JobSpec,
    JobView,
    QueuedEvent,
    Timings,
    Usage,
)
from shared.scripts import Scripts
from shared.settings import GatewaySettings

_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


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
        scripts: Scripts,
        registry: ModelRegistry,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.scripts = scripts
        self.registry = registry
        self.keys = Keys(settings.key_prefix)

    def validate_id(self, job_id: str) -> str:
        if not _JOB_ID.match(job_id):
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
        """Queue a job atomically (record + event log + queue entry); honour Idempotency-Key."""
        spec = spec or await self.prepare(body)
        fingerprint = _fingerprint(body)
        if idempotency_key is not None:
            earlier = await self._claim_idempotency_key(idempotency_key, spec.id, fingerprint)
            if earlier is not None:
                return Submitted(earlier, replayed=True)
        k = self.keys
        prompt_tokens = len(spec.input_ids)
        queued = QueuedEvent(
            seq=1, id=spec.id, model=spec.model, priority=spec.priority, prompt_tokens=prompt_tokens
        ).model_dump_json()
        record = {
            "spec": spec.model_dump_json(),
            "status": "queued",
            "attempt": 0,
            "model": spec.model,
            "priority": spec.priority,
            "created_at": repr(spec.created_at),
            "metadata": json.dumps(body.metadata),
            "fingerprint": fingerprint,
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(k.job(spec.id), mapping=record)
        pipe.xadd(k.events(spec.id), {"d": queued}, id=event_id(1))
        pipe.publish(k.channel(spec.id), queued)
        pipe.xadd(
            k.queue(spec.model, spec.priority),
            {"job": spec.id, "tokens": prompt_tokens + spec.max_tokens},
        )
        if spec.deadline is not None:  # workers sweep this index to expire jobs still queued
            pipe.zadd(k.deadlines(), {spec.id: spec.deadline})
        await pipe.execute()
        view = JobView(
            id=spec.id,
            status="queued",
            model=spec.model,
            priority=spec.priority,
            created_at=spec.created_at,
            metadata=body.metadata,
        )
        return Submitted(view, replayed=False)

    async def _claim_idempotency_key(
        self, key: str, job_id: str, fingerprint: str
    ) -> JobView | None:
        """None if `key` is new (now bound to `job_id`); else the job it already names."""
        if not _IDEMPOTENCY_KEY.match(key):
            raise BadRequest(
                "Idempotency-Key must be 1 to 255 visible ASCII characters", param="Idempotency-Key"
            )
        idem = self.keys.idempotency(key)
        ttl = self.settings.idempotency_ttl_s
        for _ in range(2):
            if await self.redis.set(idem, job_id, nx=True, ex=ttl):
                return None
            earlier_id = await self.redis.get(idem)
            if earlier_id is None:
                continue
            raw = await self.redis.hgetall(self.keys.job(earlier_id))
            if not raw:  # the earlier job expired (or its submission died): the key is free
                await self.redis.delete(idem)
                continue
            if raw.get("fingerprint") != fingerprint:
                raise Unprocessable(
                    "Idempotency-Key was already used with a different request body",
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                )
            return _view(earlier_id, raw)
        raise Conflict(
            "Idempotency-Key is being claimed concurrently; retry", param="Idempotency-Key"
        )

    async def get(self, job_id: str) -> JobView:
        raw = await self.redis.hgetall(self.keys.job(self.validate_id(job_id)))
        if not raw:
            raise JobNotFound(f"no job '{job_id}' (unknown, or expired)", param="id")
        return _view(job_id, raw)

    async def cancel(self, job_id: str, reason: str = "cancelled") -> JobView:
        """Cancel a queued job at once, or ask the worker running it to stop."""
        k = self.keys
        self.validate_id(job_id)
        s = self.settings
        reply = await self.scripts.cancel(
            keys=[k.job(job_id), k.events(job_id), k.channel(job_id)],
            args=[repr(time.time()), s.retention_s, s.event_log_maxlen, reason],
        )
        if reply[0] == "missing":
            raise JobNotFound(f"no job '{job_id}' (unknown, or expired)", param="id")
        if reply[0] == "running" and reply[1]:
            await self.redis.publish(k.control(reply[1]), json.dumps({"cancel": job_id}))
        elif reply[0] in TERMINAL_STATUSES:
            raise Conflict(f"job '{job_id}' already ended: {reply[0]}", param="id")
        return await self.get(job_id)


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


def _view(job_id: str, raw: dict[str, str]) -> JobView:
    spec = JobSpec.model_validate_json(raw["spec"])
    result = JobResult.model_validate_json(raw["result"]) if "result" in raw else None
    return JobView(
        id=job_id,
        status=raw["status"],  # type: ignore[arg-type]
        model=spec.model,
        priority=spec.priority,
        attempt=int(raw.get("attempt", 0)),
        worker=raw.get("worker"),
        created_at=spec.created_at,
        started_at=_float(raw.get("started_at")),
        finished_at=_float(raw.get("finished_at")),
        text=result.text if result else None,
        finish_reason=result.finish_reason if result else None,
        usage=Usage.model_validate_json(raw["usage"]) if "usage" in raw else None,
        timings=Timings.model_validate_json(raw["timings"]) if "timings" in raw else None,
        error=ErrorInfo.model_validate_json(raw["error"]) if "error" in raw else None,
        metadata=json.loads(raw.get("metadata", "{}")),
    )


def _float(v: Any) -> float | None:
    return float(v) if v is not None else None
