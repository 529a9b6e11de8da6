"""The models the fleet serves: cards and tokenizers (written by workers), cached per gateway
process, and the live workers' heartbeats."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from tokenizers import Tokenizer

from shared.errors import ModelNotFound, Unavailable, shown
from shared.keys import Keys
from shared.records import Heartbeat, RecordError
from shared.schemas import ModelCard

log = logging.getLogger(__name__)
_TOKENIZERS_KEPT = 16
STARTING_RETRY_S = 2
"""`Retry-After` of the 503 for a configured model no worker has registered yet: a worker
registers at once when its model is loaded."""


@dataclass(slots=True)
class LoadedCard:
    card: ModelCard
    tokenizer: Tokenizer


class ModelRegistry:
    """`expected`: the models this gateway is configured to serve (`queue_models`): one no
    worker has registered yet is starting (503), not unknown (404)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        ttl_s: float,
        expected: frozenset[str] = frozenset(),
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_s = ttl_s
        self._expected = expected
        self._cards: dict[str, tuple[float, ModelCard]] = {}
        self._tokenizers: dict[str, Tokenizer] = {}
        self._lock = asyncio.Lock()

    async def get(self, model: str) -> LoadedCard:
        """The card of `model` with its tokenizer; ModelNotFound if no worker ever served it
        (Unavailable if it is an expected one)."""
        hit = self._cards.get(model)
        if hit is not None and time.monotonic() - hit[0] < self._ttl_s:
            card = hit[1]
        else:
            raw = await self._redis.hget(self._keys.model_card(model), "card")
            if raw is None and model in self._expected:
                raise Unavailable(
                    f"model {shown(model)} is starting: no worker of it has registered yet; "
                    "retry shortly",
                    param="model",
                    code="model_starting",
                    retry_after_s=STARTING_RETRY_S,
                )
            if raw is None:
                known = sorted(await self._redis.smembers(self._keys.models()))
                raise ModelNotFound(
                    f"model {shown(model)} is not served here; known models: {known or 'none'}",
                    param="model",
                )
            card = ModelCard.model_validate_json(raw)
            self._cards[model] = (time.monotonic(), card)
        tok = self._tokenizers.get(card.tokenizer_sha)
        if tok is None:
            tok = await self._load_tokenizer(model, card)
        return LoadedCard(card, tok)

    async def _load_tokenizer(self, model: str, card: ModelCard) -> Tokenizer:
        async with self._lock:
            tok = self._tokenizers.get(card.tokenizer_sha)
            if tok is None:
                raw = await self._redis.hget(self._keys.model_card(model), "tokenizer")
                if raw is None:
                    raise ModelNotFound(f"model '{model}' has no tokenizer yet", param="model")
                tok = Tokenizer.from_str(raw)
                if len(self._tokenizers) >= _TOKENIZERS_KEPT:
                    self._tokenizers.pop(next(iter(self._tokenizers)))
                self._tokenizers[card.tokenizer_sha] = tok
        return tok

    async def live_workers(self) -> list[Heartbeat]:
        """Heartbeats of workers whose lease has not lapsed."""
        ids = await self._redis.zrangebyscore(self._keys.workers(), time.time(), "+inf")
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self._keys.worker(worker_id))
        beats = []
        for worker_id, raw in zip(ids, await pipe.execute(), strict=True):
            if not raw:
                continue
            try:
                beats.append(Heartbeat.from_hash(raw))
            except RecordError as exc:  # a worker of another version, or a forged hash
                log.warning(
                    "unreadable heartbeat", extra={"worker_id": worker_id, "error": str(exc)}
                )
        return beats
