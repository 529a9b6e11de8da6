"""Admission on the worker's side of the engine boundary: can a job start now?

The claim loop asks before it STARTs a claim; the job reaches the engine a Redis round trip
and a socket hop later, and the engine's page count comes back with its next step. So the
worker keeps the engine's last reported free pages, less the pages it has *promised* since:
  - a promise per job `fits()` admitted whose add has not gone out yet; one not redeemed
    within `PROMISE_TTL_S` (START refused the job, or it ended before reaching the engine)
    lapses;
  - a reservation per add sent (the job's own pages), until the engine reports having
    applied that add (its count of applied adds), when its free pages include the job.
Batch slots are counted exactly by the caller (`active`: jobs started and not ended).

An engine with `page_size` 0 counts no pages: only batch slots limit it (the sim engine).
"""

from __future__ import annotations

import collections
import math
import time

PROMISE_TTL_S = 5.0
"""How long pages admitted by `fits()` stay reserved waiting for the job's add."""


def pages_for(tokens: int, page_size: int, reserved_tokens: int = 0) -> int:
    """Pages a job of `tokens` (prompt + max new) holds from its start to its end; the engine
    may hold `reserved_tokens` more per job (exllamav3: one)."""
    return max(1, math.ceil((tokens + reserved_tokens) / page_size))


class Admission:
    def __init__(
        self,
        max_batch: int,
        page_size: int,
        total_pages: int,
        free_pages: int,
        reserved_tokens: int = 0,
    ) -> None:
        self.max_batch = max_batch
        self.page_size = page_size
        self.reserved_tokens = reserved_tokens
        """Tokens the engine holds per job beyond prompt + max new (`Engine.reserved_tokens`)."""
        self.total_pages = total_pages
        self.free_pages = free_pages
        """As the engine last reported it."""
        self._promises: collections.deque[tuple[float, int]] = collections.deque()
        """(expiry, pages) of jobs admitted whose add has not been sent."""
        self._sent: collections.deque[tuple[int, int]] = collections.deque()
        """(add number, pages) of adds sent that the engine has not reported yet."""
        self._adds_sent = 0

    def fits(self, need_tokens: int, active: int, slots: int | None = None) -> bool:
        """Whether a job of `need_tokens` (prompt + max new) could start now beside `active`
        jobs, of at most `slots` (default: the max batch; more for jobs started ahead, which
        wait at the engine's doorstep, worker/core.py); if so, its pages are promised to it."""
        if active >= (self.max_batch if slots is None else slots):
            return False
        if not self.page_size:
            return True
        need = pages_for(need_tokens, self.page_size, self.reserved_tokens)
        if need > self.total_pages:
            return True  # claim it so that the engine fails it with a clear error, not leave it
        now = time.monotonic()
        if active == 0:
            self._promises.clear()  # nothing is between fits() and its add: no promise is live
        while self._promises and self._promises[0][0] < now:
            self._promises.popleft()
        promised = sum(p for _, p in self._promises) + sum(p for _, p in self._sent)
        if need > self.free_pages - promised:
            return False
        self._promises.append((now + PROMISE_TTL_S, need))
        return True

    def in_use(self) -> float:
        """The share of the cache's pages taken or promised to jobs admitted (0 to 1; 0 for
        an engine without pages): what `genq_kv_cache_usage_perc` reports."""
        if not self.page_size or not self.total_pages:
            return 0.0
        promised = sum(p for _, p in self._promises) + sum(p for _, p in self._sent)
        free = max(0, self.free_pages - promised)
        return min(1.0, 1.0 - free / self.total_pages)

    def sent(self, need_tokens: int) -> None:
        """An add went to the engine: the oldest promise becomes a reservation of this job's
        pages until the engine reports the add applied."""
        self._adds_sent += 1
        if self._promises:
            self._promises.popleft()
        if self.page_size:
            pages = pages_for(need_tokens, self.page_size, self.reserved_tokens)
            self._sent.append((self._adds_sent, pages))

    def report(self, free_pages: int, adds_applied: int) -> None:
        """What the engine said after its last step: its free pages, counting every add it
        had applied."""
        self.free_pages = free_pages
        while self._sent and self._sent[0][0] <= adds_applied:
            self._sent.popleft()

    def restart(self, free_pages: int) -> None:
        """A new engine process (its add count starts again): nothing is promised to it."""
        self.free_pages = free_pages
        self._promises.clear()
        self._sent.clear()
        self._adds_sent = 0
