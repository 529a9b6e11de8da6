"""Prompt pages and their hash chain: how genq names what a prefix cache holds.

Both engines cache prompts in pages of `PAGE_TOKENS` (256) tokens and reuse a page only when
every token before it is the same. `page_hashes` names each full page of a token sequence by a
hash of the page's tokens chained to the hash of the page before it, so two sequences share
their first k hashes exactly when they share their first k pages. The gateway computes a
job's chain from its prompt (placement); the sim engine keys its prefix cache by it; a worker
summarises its cache as the set of hashes it holds.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Collection, Sequence

PAGE_TOKENS = 256
"""Tokens per cache page (exllamav2's paged attention, exllamav3's PAGE_SIZE)."""
_SEED = b"genq-pages-v1"


def page_hashes(token_ids: Sequence[int], page: int = PAGE_TOKENS) -> list[int]:
    """The chain of 64-bit hashes of `token_ids`' full pages (a last partial page has none)."""
    out: list[int] = []
    prev = _SEED
    for start in range(0, len(token_ids) - page + 1, page):
        chunk = token_ids[start : start + page]
        digest = hashlib.blake2b(
            struct.pack(f"<{len(chunk)}I", *(t & 0xFFFFFFFF for t in chunk)),
            digest_size=8,
            key=prev[:64],
        ).digest()
        out.append(int.from_bytes(digest, "little"))
        prev = digest
    return out


def shared_pages(chain: Sequence[int], held: Collection[int]) -> int:
    """How many leading pages of `chain` are in `held` (a prefix cache reuses no page after
    the first it lacks)."""
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


def pack_summary(hashes: Sequence[int]) -> str:
    """Page hashes as a worker publishes them (`Keys.cache_summary`): little-endian 64-bit,
    base64 (Redis clients here read text)."""
    return base64.b64encode(struct.pack(f"<{len(hashes)}Q", *hashes)).decode()


def unpack_summary(text: str | None) -> frozenset[int]:
    """The page hashes of a published summary (none for a missing or damaged one)."""
    if not text:
        return frozenset()
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return frozenset()
    n = len(raw) // 8
    return frozenset(struct.unpack(f"<{n}Q", raw[: n * 8]))
