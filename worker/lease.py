"""A worker's view of its own lease, and which pending queue entries it may take over.

The lease is the heartbeat key's TTL (`lease_s`), refreshed every `heartbeat_s`. A worker that
has not renewed it for a whole lease (paused, cut off from Redis) must assume its jobs moved:
it stops starting claims until a beat succeeds again. After Redis itself was away, every
worker's heartbeat key may have lapsed at once, so a worker waits one lease after Redis comes
back before it takes over anyone's entries: the other workers need that long to beat again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class LeaseClock:
    lease_s: float
    last_ok: float = field(default_factory=time.monotonic)
    """When a heartbeat last reached Redis (monotonic)."""
    ok_since: float | None = None
    """Start of the current run of successful beats; None while beats fail. At start-up the
    worker has seen no outage, so it may reclaim at once (None → `reclaim_allowed` True)."""
    failed: bool = False

    def beat_ok(self) -> None:
        now = time.monotonic()
        if self.failed:
            self.ok_since = now
            self.failed = False
        self.last_ok = now

    def beat_failed(self) -> None:
        self.failed = True

    def held(self) -> bool:
        """Whether this worker still holds its lease (a beat landed within one lease)."""
        return time.monotonic() - self.last_ok < self.lease_s

    def reclaim_allowed(self) -> bool:
        if self.failed:
            return False
        return self.ok_since is None or time.monotonic() - self.ok_since >= self.lease_s


def reclaimable(
    pending: Iterable[tuple[str, str]], me: str, held: set[str], alive: set[str]
) -> list[str]:
    """Entry ids (from idle (entry id, consumer) pairs) whose owner is gone, or is this worker
    but no longer holds them (a failed hand-back or ack): either way no one will finish them."""
    out = []
    for entry_id, consumer in pending:
        if consumer == me:
            if entry_id not in held:
                out.append(entry_id)
        elif consumer not in alive:
            out.append(entry_id)
    return out
