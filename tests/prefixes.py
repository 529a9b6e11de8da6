"""Key prefixes of one test run: every test's keys in the shared Redis sit under this run's
`genqtest:<session>:`, so what a test left behind (a killed process's queues, a failed
cleanup) is removed at the run's end (tests/conftest.py) and nothing of another run's is."""

from __future__ import annotations

import os
import uuid

SESSION = os.environ.get("GENQ_TEST_SESSION") or uuid.uuid4().hex[:6]
"""GENQ_TEST_SESSION names it (tests/e2e/test_no_keys_left.py runs the suite under a known one)."""
RUN_PREFIX = f"genqtest:{SESSION}:"


def test_prefix(tag: str = "") -> str:
    """A fresh key prefix for one test (or one process group), within this run's; `tag`
    names it in `redis-cli --scan` output."""
    return f"{RUN_PREFIX}{tag}{'-' if tag else ''}{uuid.uuid4().hex[:8]}:"


test_prefix.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test
