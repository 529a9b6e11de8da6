"""A job's constraint on the worker: an llguidance matcher over the engine's tokenizer.

The gateway compiled and checked the job's grammar (gateway/constraints.py) with the same
library and limits; the engine builds one matcher per job from it (`Grammars.matcher`), feeds
it the tokens an earlier attempt generated (`replay`: a job continued on another worker goes
on inside its constraint), then at each step asks which tokens may come next (`allowed`, or
a bitmask row for a batch: `fill_rows`) and tells it the token sampled (`consume`).

Building a matcher compiles the grammar's lexer (milliseconds for a large schema); the first
one per grammar is kept (`Grammars`, an LRU) and each job gets a cheap copy of it.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance

from shared.constraints import CONSTRAINT_FAILED, LIMITS, llg_error, llg_tokenizer
from worker.engine import JobRefused

GRAMMARS_KEPT = 256
"""Compiled grammars an engine keeps (each job of one gets a copy of its first matcher)."""


class ConstraintError(JobRefused):
    """A job's grammar cannot run here, or its tokens left it (a replay that does not fit):
    the job's own fault, the same on every worker (it fails with `CONSTRAINT_FAILED`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, CONSTRAINT_FAILED)


class JobMatcher:
    """One job's place in its grammar."""

    __slots__ = ("m",)

    def __init__(self, m: Any) -> None:
        self.m = m

    def replay(self, token_ids: Sequence[int]) -> None:
        """Advance over tokens an earlier attempt generated (and sent); ConstraintError if
        they do not fit the grammar (they always do, unless the grammar changed)."""
        if token_ids and not (self.m.consume_tokens(list(token_ids)) and not self.failed):
            raise ConstraintError(
                f"the {len(token_ids)} tokens an earlier attempt generated do not fit the "
                f"constraint: {self.error}"
            )

    def consume(self, token_id: int) -> bool:
        """Take the sampled token; False if the grammar does not allow it, or the matcher
        failed (it is then in error: the job cannot go on). A failed matcher takes EOS, as
        a complete one does: only `failed` tells them apart."""
        return bool(self.m.consume_token(token_id)) and not self.failed

    def allowed_bits(self) -> bytes:
        """The next-token mask: bit i of the little-endian 32-bit words set when token i may
        come next (EOS among them once the grammar may end)."""
        return bytes(self.m.compute_bitmask())

    def fill_row(self, pointer: int, nbytes: int) -> None:
        """Write the next-token mask into memory at `pointer` (a bitmask row of `nbytes`)."""
        self.m.unsafe_compute_mask_ptr(pointer, nbytes)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more: the job ends here. (llguidance
        calls a failed matcher stopped too; this does not.)"""
        return bool(self.m.is_stopped()) and not self.failed

    @property
    def accepting(self) -> bool:
        return bool(self.m.is_accepting())

    @property
    def failed(self) -> bool:
        """The matcher is in error (a token it refused, or a limit its lexer or parser hit
        while computing a mask): its masks allow EOS alone, and the job cannot go on."""
        return bool(self.m.is_error())

    @property
    def error(self) -> str:
        """Why it failed, in llguidance's words ('' when it has not)."""
        return llg_error(str(self.m.get_error())) if self.failed else ""


class Grammars:
    """An engine's matchers: one tokenizer, and the compiled grammars it has seen."""

    def __init__(
        self, tokenizer_json: str, eos_ids: Sequence[int], vocab_size: int | None = None
    ) -> None:
        self.tokenizer = llg_tokenizer(tokenizer_json, list(eos_ids), vocab_size)
        self.vocab_size = int(self.tokenizer.vocab_size)
        self._kept: OrderedDict[str, Any] = OrderedDict()

    def matcher(self, grammar: str, replay: Sequence[int] = ()) -> JobMatcher:
        """A fresh matcher for `grammar`, advanced over `replay`; ConstraintError if the
        grammar does not build here or the tokens do not fit it."""
        first = self._kept.get(grammar)
        if first is None:
            first = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
            if first.is_error():
                why = llg_error(str(first.get_error()))
                raise ConstraintError(f"the constraint does not build on this worker: {why}")
            self._kept[grammar] = first
            while len(self._kept) > GRAMMARS_KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(grammar)
        job = JobMatcher(first.deep_copy())
        job.replay(replay)
        return job


class MaskBatch:
    """Next-token masks of many jobs at once: computed by llguidance's thread pool (which lets
    go of the GIL) into one buffer, a row of `row_bytes` per job."""

    def __init__(self, vocab_size: int, threads: int | None = None) -> None:
        self.row_bytes = (vocab_size + 31) // 32 * 4
        self._buf = bytearray()
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def fill(self, matchers: Sequence[JobMatcher]) -> list[memoryview]:
        """Each matcher's mask (a row, in order); valid until the next `fill`."""
        need = len(matchers) * self.row_bytes
        if len(self._buf) < need:
            self._buf = bytearray(need)
        if matchers:
            rows = (ctypes.c_char * len(self._buf)).from_buffer(self._buf)
            pairs = [(j.m, i) for i, j in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(
                pairs, ctypes.addressof(rows), self.row_bytes, len(matchers)
            )
            del rows  # the buffer may be resized later: no export may outlive this call
        view = memoryview(self._buf)
        return [view[i * self.row_bytes : (i + 1) * self.row_bytes] for i in range(len(matchers))]


def allows(row: bytes | memoryview, token_id: int) -> bool:
    """Whether `token_id`'s bit is set in a mask row."""
    byte = token_id >> 3
    return byte < len(row) and bool(row[byte] >> (token_id & 7) & 1)


def allowed_ids(bits: bytes | memoryview, limit: int) -> list[int]:
    """Token ids whose bit is set in a mask from `JobMatcher.allowed_bits` (below `limit`)."""
    out: list[int] = []
    for byte_index, byte in enumerate(bits):
        if not byte:
            continue
        base = byte_index * 8
        out += [base + b for b in range(8) if byte >> b & 1 and base + b < limit]
    return out
