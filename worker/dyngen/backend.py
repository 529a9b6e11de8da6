"""What an engine loads from its library (`Backend`), and what both loaders size and build
the same way: the cache, the warmed-up first generator, the token-piece lookup."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.pages import PAGE_TOKENS as PAGE_TOKENS

# PAGE_TOKENS: the page of both libraries' paged caches (exllamav2's paged attention,
# `exllamav3.constants.PAGE_SIZE`); cache and chunk sizes are multiples of it.
DEFAULT_CACHE_TOKENS_PER_JOB = 1024
"""Default cache size per batch slot when `cache_tokens` is not set: room for a typical
prompt + reply without paying for a cache sized for the worst case (which costs speed)."""


@dataclass
class Backend:
    """What the engine needs from its library; each loader's `load_backend` builds the real
    one."""

    make_generator: Callable[[], Any]
    """A fresh generator over the loaded model and cache (called again after a failed step)."""
    make_job: Callable[..., Any]
    """(input_ids, max_new_tokens, sampling, seed, stop_conditions, identifier) → a job."""
    piece: Callable[[int], str]
    """Text of one token id (as the generator decodes it)."""
    close: Callable[[], None] = lambda: None
    vocab_size: int | None = None
    """The width of the model's logits (its vocabulary rows, at least the tokenizer's): the
    vocabulary constrained jobs' matchers and masks cover (None: the tokenizer's)."""


def cache_tokens(
    configured: int | None, max_seq_len: int, max_batch: int, paged: bool = True
) -> int:
    """Tokens of cache to allocate: `configured` (GENQ_CACHE_TOKENS) if set, else room for
    the longest sequence or `DEFAULT_CACHE_TOKENS_PER_JOB` per batch slot, whichever is more;
    unpaged (one job at a time), one sequence. A multiple of the page size."""
    if not paged:
        return round_up(max_seq_len, PAGE_TOKENS)
    wanted = configured or max(max_seq_len, max_batch * DEFAULT_CACHE_TOKENS_PER_JOB)
    return round_up(wanted, PAGE_TOKENS)


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def first_warmed(warmed: Any, build: Callable[[], Any]) -> Callable[[], Any]:
    """`Backend.make_generator`: the generator warmed up at load first, then fresh ones."""
    left = [warmed]

    def make_generator() -> Any:
        return left.pop() if left else build()

    return make_generator


def piece_lookup(tokenizer: Any) -> Callable[[int], str]:
    """`Backend.piece` over a tokenizer's id → piece list (both libraries' tokenizers have
    `get_id_to_piece_list`); an id outside it is ""."""
    pieces = tokenizer.get_id_to_piece_list(False)

    def piece(token_id: int) -> str:
        return pieces[token_id] if 0 <= token_id < len(pieces) else ""

    return piece
