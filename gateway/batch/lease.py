"""A batch's lease: the one process that drives it now (`Keys.batch_lease`, a token with a
TTL). Whoever holds it renews it between steps; a holder that dies or stalls loses it after
GENQ_BATCH_LEASE_S, and every step is safe to run again, so another carries on."""

from __future__ import annotations

from shared.batch_transitions import BatchTransitions
from shared.transitions import ScriptRunner


class LeaseLost(Exception):
    """Another process drives the batch now: stop this step (what it did is safe)."""


class Lease:
    def __init__(
        self,
        scripts: ScriptRunner,
        tx: BatchTransitions,
        batch_id: str,
        *,
        token: str,
        ttl_s: float,
    ) -> None:
        self._scripts = scripts
        self._tx = tx
        self.batch_id = batch_id
        self.token = token
        self._ttl_ms = int(ttl_s * 1000)

    async def hold(self) -> bool:
        """Take the lease, or renew it; False when another holds it."""
        call = self._tx.hold(self.batch_id, token=self.token, ttl_ms=self._ttl_ms)
        return await self._scripts.run(call)

    async def renew(self) -> None:
        """Renew it; LeaseLost when another holds it now."""
        if not await self.hold():
            raise LeaseLost(self.batch_id)

    async def free(self) -> None:
        await self._scripts.run(self._tx.free(self.batch_id, token=self.token))
