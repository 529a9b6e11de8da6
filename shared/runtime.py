"""Process-wide runtime tuning shared by the gateway, worker and bench entry points."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# A streaming server allocates many short-lived objects per token; CPython's default gen-0
# threshold (700) makes it collect thousands of times a second and its full collections stall
# the event loop for tens of milliseconds under load.
_GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Freeze what startup allocated (never scanned again); collect young objects less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed (it is, with uvicorn[standard])."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
