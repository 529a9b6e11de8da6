"""Cancels: the worker's control channel, and the job records' `cancel` field read again
whenever the channel (re)subscribes, since a pub/sub message sent while it was down is lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.exceptions import RedisError

from shared.records import CANCEL_FIELD, ControlMessage, RecordError
from shared.redis_health import failure_level
from worker.engine import Stop
from worker.state import WorkerState

log = logging.getLogger(__name__)
_CONTROL_POLL_S = 1.0
_CONTROL_RETRY_S = 0.5


class Control:
    def __init__(self, st: WorkerState) -> None:
        self.st = st

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
                        self._on_message(msg["data"])
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.log(
                    failure_level(st.redis),
                    "control channel failed; resubscribing",
                    extra={"error": str(exc)},
                )
                await asyncio.sleep(_CONTROL_RETRY_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _on_message(self, data: str) -> None:
        try:
            msg = ControlMessage.decode(data)
        except RecordError as exc:
            log.warning("unreadable control message", extra={"error": str(exc)})
            return
        run = self.st.running.get(msg.cancel)
        if msg.attempt is not None and run is not None and run.attempt != msg.attempt:
            return  # meant for an attempt this worker no longer runs
        if msg.expire:
            if run is not None:
                self.st.stop(run, Stop("expired"))
            return
        self.st.cancel(msg.cancel, msg.reason)

    async def _recheck_cancels(self) -> None:
        """Cancels published while the control channel was down are lost; the job records
        still carry them (REQUEST_CANCEL sets `cancel`), so read those of every running job."""
        st = self.st
        ids = list(st.running)
        if not ids:
            return
        pipe = st.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(st.keys.job(job_id), CANCEL_FIELD)
        for job_id, reason in zip(ids, await pipe.execute(), strict=True):
            if reason:
                st.cancel(job_id, reason)
