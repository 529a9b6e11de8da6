"""Chaos tests: real processes (redis-server, `genq gateway`, `genq worker`) killed for real.

Marked `chaos` (deselect with `-m "not chaos"`); skipped where `redis-server` is missing.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.chaos.scenarios import Env, chaos_env


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.chaos)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    async with chaos_env(tmp_path) as e:
        yield e
        print(e.tail_logs())  # shown only when the test fails
