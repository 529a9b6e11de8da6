"""What this worker's engine cache holds, as placement needs to know it.

Both GPU engines keep the pages of a prompt and of its reply after the job (their prefix
cache), dropping the least recently used unreferenced page when they need room; the sim keeps
an LRU of its own (worker/sim.py). The worker mirrors that with the page hash chain of each
job it runs (shared/pages.py): a job's prompt pages when it starts, its prompt and reply pages
when it ends, in an LRU of the engine's cache size. It is a model, not a read of the engine:
no engine call, no GPU sync, the same for every engine; where it is wrong a job placed by it
finds less cached than hoped and is only as slow as without placement.

The summary published for the gateways (`Keys.cache_summary`) is the most recent
`SUMMARY_PAGES` hashes, 8 bytes each; `version` tells them when to read it again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shared.pages import PAGE_TOKENS, pack_summary, page_hashes

SUMMARY_PAGES = 8192
"""Most page hashes a summary carries (64 KiB): a cache of 2M tokens."""
DEFAULT_PAGES = 1024
"""The cache modelled for an engine that reports no pages and no size."""


class CacheModel:
    def __init__(self, pages: int) -> None:
        self.capacity = max(1, pages)
        self._held: OrderedDict[int, None] = OrderedDict()
        self.version = 0

    def touch(self, token_ids: Sequence[int]) -> None:
        """The pages of `token_ids` are in the cache now (prefilled or reused)."""
        chain = page_hashes(token_ids)
        if not chain:
            return
        for h in chain:
            self._held[h] = None
            self._held.move_to_end(h)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)
        self.version += 1

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
