"""Cancels: the worker's control channel, and the job records' `cancel` field read again
whenever the channel (re)subscribes, since a pub/sub message sent while it was down is lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from shared.schemas import ControlMessage
from worker.state import WorkerState

log = logging.getLogger(__name__)
_EARLY_CANCELS_KEPT = 1000
_EARLY_CANCEL_TTL_S = 60.0
_CONTROL_POLL_S = 1.0
_CONTROL_RETRY_S = 0.5


class Control:
    def __init__(self, st: WorkerState) -> None:
        self.st = st

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        st = self.st
        run = st.running.get(job_id)
        if run is None:  # a cancel can overtake the START reply that tells us of the job
            now = time.monotonic()
            if len(st.early_cancels) > _EARLY_CANCELS_KEPT:  # keep the newest, young ones
                young = [kv for kv in st.early_cancels.items() if now - kv[1] < _EARLY_CANCEL_TTL_S]
                young.sort(key=lambda kv: kv[1])
                st.early_cancels = dict(young[-_EARLY_CANCELS_KEPT // 2 :])
            st.early_cancels[job_id] = now
            return
        st.cancel_reason[job_id] = reason
        assert st.runner is not None
        st.runner.cancel(job_id)

    async def loop(self) -> None:
        st = self.st
        while not st.closing:
            pubsub = st.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(st.keys.control(st.id))
                await self._recheck_cancels()
                while not st.closing:
                    msg = await pubsub.get_message(timeout=_CONTROL_POLL_S)
                    if msg is not None:
                        self.cancel(ControlMessage.model_validate_json(msg["data"]).cancel)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, ValueError) as exc:
                log.warning("control channel failed; resubscribing", extra={"error": str(exc)})
                await asyncio.sleep(_CONTROL_RETRY_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _recheck_cancels(self) -> None:
        """Cancels published while the control channel was down are lost; the job records
        still carry them (CANCEL sets `cancel`), so read those of every running job."""
        st = self.st
        ids = list(st.running)
        if not ids:
            return
        pipe = st.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(st.keys.job(job_id), "cancel")
        for job_id, reason in zip(ids, await pipe.execute(), strict=True):
            if reason:
                self.cancel(job_id, reason)
