"""What this worker's engine cache holds, as placement needs to know it.

Both GPU engines keep the pages of a prompt and of its reply after the job (their prefix
cache), dropping the least recently used unreferenced page when they need room; the sim keeps
an LRU of its own (worker/sim.py). The worker mirrors that with the page hash chain of each
job it runs (shared/pages.py): a job's prompt pages when it starts, its prompt and reply pages
when it ends, in an LRU of the engine's cache size. It is a model, not a read of the engine:
no engine call, no GPU sync, the same for every engine; where it is wrong a job placed by it
finds less cached than hoped and is only as slow as without placement.

Gateways learn of each change as it happens: the pages taken in and dropped since the last
news (`take_news`) go out with the worker's next flush (`shared.records.CacheNews`). The
summary (`Keys.cache_summary`, written with the heartbeat) is the most recent `SUMMARY_PAGES`
hashes, 8 bytes each: what a gateway that missed some news reads again; `version` numbers the
changes, so a gateway sees which it missed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shared.pages import PAGE_TOKENS, pack_summary, page_hashes, shared_pages

SUMMARY_PAGES = 8192
"""Most page hashes a summary carries (64 KiB): a cache of 2M tokens."""
DEFAULT_PAGES = 1024
"""The cache modelled for an engine that reports no pages and no size."""


@dataclass(frozen=True, slots=True)
class CacheChange:
    """The pages taken in and dropped between two versions of the model."""

    since: int
    version: int
    added: list[int]
    """Most recently used last."""
    dropped: list[int]


class CacheModel:
    def __init__(self, pages: int) -> None:
        self.capacity = max(1, pages)
        self._held: OrderedDict[int, None] = OrderedDict()
        self.version = 0
        self._told = 0
        """The version the last news went out with."""
        self._added: OrderedDict[int, None] = OrderedDict()
        self._dropped: set[int] = set()

    def touch(self, token_ids: Sequence[int]) -> int:
        """The pages of `token_ids` are in the cache now (prefilled or reused); how many of
        its leading pages were there before (what the engine will not prefill again)."""
        chain = page_hashes(token_ids)
        if not chain:
            return 0
        hit = shared_pages(chain, self._held)
        for h in chain:
            self._held[h] = None
            self._held.move_to_end(h)
            self._added[h] = None
            self._added.move_to_end(h)
            self._dropped.discard(h)
        while len(self._held) > self.capacity:
            h, _ = self._held.popitem(last=False)
            self._added.pop(h, None)
            self._dropped.add(h)
        self.version += 1
        return hit

    def take_news(self) -> CacheChange | None:
        """What changed since the last call (None: nothing); from here on it is told."""
        if self.version == self._told:
            return None
        change = CacheChange(self._told, self.version, list(self._added), list(self._dropped))
        self._told = self.version
        self._added.clear()
        self._dropped.clear()
        return change

    def summary(self) -> str:
        """The most recent pages' hashes, oldest first (`shared.pages.pack_summary`)."""
        return pack_summary(list(self._held)[-SUMMARY_PAGES:])

    def __len__(self) -> int:
        return len(self._held)


def modelled_pages(page_size: int, total_pages: int, cache_tokens: int) -> int:
    """Pages to model for an engine: its own count (in 256-token pages), else the sim's
    cache size, else `DEFAULT_PAGES`."""
    if page_size and total_pages:
        return max(1, total_pages * page_size // PAGE_TOKENS)
    if cache_tokens:
        return max(1, cache_tokens // PAGE_TOKENS)
    return DEFAULT_PAGES
