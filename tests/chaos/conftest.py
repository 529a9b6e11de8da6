"""Chaos tests: real processes (redis-server, `genq gateway`, `genq worker`) killed for real."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.chaos.scenarios import Env, chaos_env


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with chaos_env(tmp_path) as e:
        yield e
        print(e.tail_logs())  # shown only when the test fails
