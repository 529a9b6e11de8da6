"""The worker's periodic summary line (GENQ_LOG_SUMMARY_INTERVAL_S; 0 = none): what it holds
now (jobs running, claims waiting to start, batch slots and KV cache pages in use, as the
worker's admission bookkeeping of its engine has them) and what it did since the last line
(jobs started, finished — all ends, then by how they ended — requeued and dead-lettered, and
tokens generated, per second)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from worker.state import StepCounts, WorkerState

log = logging.getLogger(__name__)


class Summary:
    def __init__(self, st: WorkerState) -> None:
        self.st = st
        self._last = (time.monotonic(), st.engine.tokens, dataclasses.replace(st.counts))

    async def loop(self) -> None:
        interval = self.st.settings.log_summary_interval_s
        while not self.st.closing:
            await asyncio.sleep(interval)
            log.info("worker summary", extra=self.fields())

    def fields(self) -> dict[str, Any]:
        """The summary since the last call (or the start)."""
        st = self.st
        engine, admission = st.engine, st.engine.admission
        now, tokens, counts = time.monotonic(), engine.tokens, dataclasses.replace(st.counts)
        then, tokens_then, counts_then = self._last
        self._last = (now, tokens, counts)
        elapsed = max(now - then, 1e-9)
        used_pages = max(admission.total_pages - admission.free_pages, 0)
        out: dict[str, Any] = {
            "worker_id": st.id,
            "model": st.model,
            "interval_s": round(elapsed, 3),
            "running": len(st.running),
            "claimed": len(st.waiting),
            "slots_total": engine.max_batch,
            "kv_pages_used": used_pages,
            "kv_pages_total": admission.total_pages,
            "kv_use": round(used_pages / admission.total_pages, 4)
            if admission.total_pages
            else None,
            "tokens": tokens - tokens_then,
            "tokens_per_s": round((tokens - tokens_then) / elapsed, 1),
        }
        since = _since(counts, counts_then)
        out["finished"] = sum(since[s] for s in ("succeeded", "failed", "expired", "cancelled"))
        out.update(since)
        if engine.down is not None:
            out["engine_down"] = engine.down
        return out


def _since(now: StepCounts, then: StepCounts) -> dict[str, int]:
    return {f.name: getattr(now, f.name) - getattr(then, f.name) for f in dataclasses.fields(now)}
