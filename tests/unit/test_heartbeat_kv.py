"""The heartbeat's KV cache use is the worker's admission bookkeeping of the engine: pages used
(or spoken for by jobs starting) of all; nothing for an engine that counts no pages."""

from __future__ import annotations

from worker.admission import Admission
from worker.upkeep import _kv_pages


def test_pages_used_are_the_engines_total_less_its_free() -> None:
    admission = Admission(max_batch=8, page_size=256, total_pages=100, free_pages=70)
    assert _kv_pages(admission) == (30, 100)
    admission.report(free_pages=100, adds_applied=0)
    assert _kv_pages(admission) == (0, 100)


def test_an_engine_without_pages_reports_none() -> None:
    assert _kv_pages(Admission(max_batch=8, page_size=0, total_pages=0, free_pages=0)) == (0, 0)
