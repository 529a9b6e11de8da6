"""Admission from free cache pages: whether a job could start now beside the running ones.

`fits()` is asked on the asyncio side before a job is claimed from Redis; the job reaches the
engine's `add()` on the engine thread a Redis round trip later. So free pages are a snapshot
the engine thread `report`s after every call that changes them, less the pages *promised* to
jobs that `fits()` admitted and `add()` has not seen yet (`redeem`). A promise not redeemed
within `PROMISE_TTL_S` (the START script refused the job) lapses.

Nothing here knows the engine's library: it takes a page size, a page count, batch slots and
reports of free pages, which is all an engine running in a process of its own would send the
I/O side each step.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable

PROMISE_TTL_S = 5.0
"""How long pages admitted by `fits()` stay reserved waiting for the job's `add()`."""


class PageAdmission:
    def __init__(
        self,
        *,
        page_size: int,
        total_pages: int,
        max_batch: int,
        reserved_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.page_size = page_size
        self.total_pages = total_pages
        self.max_batch = max_batch
        self.reserved_tokens = reserved_tokens
        """Tokens the engine reserves per job beyond prompt + max new tokens."""
        self._clock = clock
        self._free_pages = total_pages
        self._promises: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def pages_for(self, tokens: int) -> int:
        """Pages a job of `tokens` (prompt + max new) holds from its start to its end."""
        return max(1, math.ceil((tokens + self.reserved_tokens) / self.page_size))

    def fits(self, need_tokens: int, active: int) -> bool:
        """Whether a job of `need_tokens` could start beside `active` jobs; if so, its pages
        are promised to it until its `add()`. A job larger than the whole cache fits: claimed,
        the engine fails it with a clear error instead of leaving it queued forever."""
        if active >= self.max_batch:
            return False
        need = self.pages_for(need_tokens)
        if need > self.total_pages:
            return True
        now = self._clock()
        with self._lock:
            if active == 0:
                self._promises.clear()  # nothing is between fits() and add(): no promise is live
            while self._promises and self._promises[0][0] < now:
                self._promises.popleft()
            promised = sum(p for _, p in self._promises)
            if need > self._free_pages - promised:
                return False
            self._promises.append((now + PROMISE_TTL_S, need))
            return True

    def report(self, free_pages: int) -> None:
        """Engine thread: the pages free now, less what jobs waiting in the engine will take."""
        self._free_pages = free_pages

    def redeem(self) -> None:
        """Engine thread: a job admitted by `fits()` reached `add()`."""
        with self._lock:
            if self._promises:
                self._promises.popleft()

    def clear(self) -> None:
        with self._lock:
            self._promises.clear()
