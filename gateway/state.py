"""What a gateway process holds for its lifetime (built by the lifespan, shared via app.state)."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.cards import CardCache
from gateway.jobs import JobService
from gateway.pubsub import PubSubRouter
from shared.keys import Keys
from shared.settings import Settings


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    redis: aioredis.Redis
    keys: Keys
    router: PubSubRouter
    cards: CardCache
    jobs: JobService
    draining: bool = False
