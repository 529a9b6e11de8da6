"""What a gateway process holds for its lifetime (built by the lifespan, shared via app.state)."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.admission import AdmissionControl
from gateway.job_service import JobService
from gateway.presence import Presence
from gateway.pubsub import PubSubRouter
from gateway.registry import ModelRegistry
from gateway.stopping import Stopping
from shared.keys import Keys
from shared.settings import GatewaySettings


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    redis: aioredis.Redis
    keys: Keys
    router: PubSubRouter
    registry: ModelRegistry
    jobs: JobService
    presence: Presence
    stopping: Stopping
    draining: bool = False
    """The gateway stops: new requests get a 503."""

    @property
    def admission(self) -> AdmissionControl:
        return self.jobs.admission
