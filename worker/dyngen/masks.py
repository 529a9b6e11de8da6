"""Constrained jobs on the GPU engines: each decode step's token masks, applied to the logits on
the device before anything samples them.

A constrained job (`EngineJob.grammar`) gets an llguidance matcher at `add`
(worker/constraint.py, replayed over the tokens an earlier attempt generated), kept on the
library's job as `genq_matcher`. Each decode step, in the hook both engines already have after
the forward pass (exllamav2's `forward_chunk`, exllamav3's decode `forward`):

1. `StepMasks.apply` finds the constrained rows in the generator's row order
   (`constrained_rows`), and has llguidance write their next-token bitmasks into a pinned host
   buffer on CPU threads (`LLExecutor`, in Rust, the GIL released) while the GPU still runs
   the forward pass: the hook is called before anything synchronises.
2. One non-blocking copy takes the masks to the GPU; there their bits are unpacked and every
   disallowed token of a constrained row gets `MASKED` in the logits themselves, in place.
   Unconstrained rows are not touched, and a step without constrained jobs costs one walk
   over the active jobs.
3. Whatever samples the row then sees only allowed tokens: genq's batched pass
   (worker/dyngen/batch_pass.py), exllamav2's CPU sampler (the logits copied to the host
   after the hook: penalties, top logprobs), exllamav3's own per-job sampler (a job's first
   token, penalties, logprobs, steps below GENQ_BATCHED_SAMPLING_MIN_JOBS) alike. Reported
   probabilities are those of the masked distribution.
4. When the token is known, the job's `receive_sample` queues it for its matcher
   (`StepMasks.take`); after the generator's step the engine has every queued token consumed
   (`StepMasks.consume`, which the next step's masks also do first, and which counts their
   time for the step profile). A matcher whose grammar is complete allows only EOS, which the
   job's stop conditions hold (the card's EOS ids): the next step ends the job with `stop`. A
   token the matcher refuses (from a masked row only when the matcher failed: its mask is
   then EOS alone) marks the job `genq_failed`, and the engine fails it before its output
   goes out (`DynamicEngine`).

Both engines start a step's masks on a thread of their own just before the forward pass
(`StepMasks.start`), so that llguidance computes them while the pass is launched and runs;
`apply` takes them when the step's rows are those. `StepMasks.profile()` says where a
constrained step's host time went (the masks' wait, the copy's launch, the consumes).

The host buffer is reused every step: the copy that read it last was queued before the last
step's tokens were read back to the host, which waits for it.

Imports torch only inside `StepMasks`; the rest is plain Python and tested on a CPU install.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.constraint import JobMatcher

MASKED = -65504.0
"""What a disallowed token's logit becomes: the value exllamav2 gives its padding columns.
Finite (exllamav3 refuses non-finite logits at a job's first token), representable in fp16,
and far below any real logit, so every sampler gives it probability 0."""
MASK_THREADS = 8
"""Most llguidance threads computing one step's masks: more than enough for 256 rows
(tens of microseconds each) within a forward pass of tens of milliseconds."""


def mask_threads() -> int:
    """Threads for the mask pool: no more than this process may use CPUs (its pinned set)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MASK_THREADS, usable or 1))


def mask_words(vocab_size: int) -> int:
    """32-bit words of one token mask over `vocab_size` tokens (llguidance's row width)."""
    return (vocab_size + 31) // 32


@dataclass
class MaskRows:
    rows: list[int] = field(default_factory=list)
    """Row of each constrained job in the step's logits."""
    matchers: list[JobMatcher] = field(default_factory=list)
    total_rows: int = 0


def constrained_rows(active_jobs: Iterable[Any]) -> MaskRows:
    """The rows of this decode step in the order both generators stack them (each active job
    whose prefill is done, one row per sequence), and which of them are constrained."""
    out = MaskRows()
    for job in active_jobs:
        if not job.is_prefill_done():
            continue
        m: JobMatcher | None = getattr(job, "genq_matcher", None)
        if m is not None:
            out.rows.append(out.total_rows)
            out.matchers.append(m)
        out.total_rows += len(job.sequences)
    return out


def fill_masks(
    executor: Any, matchers: Sequence[JobMatcher], pointer: int, words: int, capacity: int
) -> None:
    """Write each matcher's next-token mask into row i of the int32 buffer at `pointer`
    (`capacity` rows of `words` words), on llguidance's threads."""
    pairs = [(m.m, i) for i, m in enumerate(matchers)]
    executor.unsafe_compute_mask_ptr(pairs, pointer, words * 4, capacity)


def _same(a: MaskRows, b: MaskRows) -> bool:
    """Whether two plans are of the same rows, matcher for matcher."""
    return (
        a.rows == b.rows
        and a.total_rows == b.total_rows
        and all(x is y for x, y in zip(a.matchers, b.matchers, strict=True))
    )


class StepMasks:
    """One generator's mask step (installed with its sampling hook); counts what it did."""

    def __init__(self, vocab_size: int, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.threads = threads or mask_threads()
        self._executor: Any = None
        self._host: Any = None
        self._device: Any = None
        self._shifts: Any = None
        self.masked_rows = 0
        self.steps = 0
        """Decode steps with constrained rows."""
        self.seconds = 0.0
        """Host time in `apply` (mostly llguidance's, while the forward pass runs)."""
        self.prefetched = 0
        """Steps whose masks were computed while the forward pass was being launched."""
        self.wait_s = 0.0
        """Of `seconds`: waiting for the masks started ahead, or computing them in `apply`."""
        self.launch_s = 0.0
        """Of `seconds`: launching the copy to the device and the masking there."""
        self.start_s = 0.0
        """Host time in `start` (handing the masks to their thread)."""
        self.consumed = 0
        self.consume_s = 0.0
        """Host time feeding the sampled tokens to the matchers (`consume`)."""
        self._ahead: tuple[MaskRows, Any] | None = None
        self._filler: Any = None
        self._taken: list[tuple[Any, JobMatcher, int]] = []
        """(job, its matcher, its token) sampled since the last `consume`."""
        self._taken_ids: set[int] = set()

    def take(self, job: Any, token: Any) -> None:
        """The token a job just sampled (an int or a one-element tensor on the host), for its
        matcher at the next `consume`; nothing for a job without a matcher, for a
        token-healing step (`new_tokens` < 0, which rewrites the prompt's last token) or a job
        that failed already."""
        m: JobMatcher | None = getattr(job, "genq_matcher", None)
        if m is None or job.new_tokens < 0 or getattr(job, "genq_failed", None):
            return
        if id(m) in self._taken_ids:  # a second token before the first was consumed: in order
            self.consume()
        self._taken.append((job, m, int(token)))
        self._taken_ids.add(id(m))

    def consume(self) -> None:
        """Feed every token `take`n since the last call to its matcher, in order; a job whose
        token its grammar refuses is marked `genq_failed` (the engine fails it before its
        output goes out). One call per job on this thread: llguidance's parallel
        `consume_token_par` measured 10-40 x slower for 64-256 matchers (tests.bench.masks)."""
        taken = self._taken
        if not taken:
            return
        started = time.perf_counter()
        self._taken, self._taken_ids = [], set()
        for job, m, token_id in taken:
            if not m.consume(token_id):
                job.genq_failed = f"at token {token_id}: {m.error or 'a token it does not allow'}"
        self.consumed += len(taken)
        self.consume_s += time.perf_counter() - started

    def profile(self) -> dict[str, float | int]:
        """The counters, for a profile of constrained steps (their totals so far)."""
        return {
            "mask_steps": self.steps,
            "masked_rows": self.masked_rows,
            "mask_prefetched": self.prefetched,
            "mask_apply_s": round(self.seconds, 6),
            "mask_wait_s": round(self.wait_s, 6),
            "mask_launch_s": round(self.launch_s, 6),
            "mask_start_s": round(self.start_s, 6),
            "consumed": self.consumed,
            "consume_s": round(self.consume_s, 6),
        }

    def start(self, active_jobs: Iterable[Any]) -> None:
        """Before a forward pass: compute this step's masks on a thread of their own while
        the pass is launched and runs (an engine whose forward synchronises before its hook,
        exllamav2's, would otherwise compute them after the pass, on the step's critical
        path). `apply` takes them if its rows are these; nothing here for a step without
        constrained rows, nor before `apply` has made buffers of the size needed."""
        self.consume()
        self._settle()
        began = time.perf_counter()
        plan = constrained_rows(active_jobs)
        host = self._host
        if not plan.rows or host is None or host.shape[0] < len(plan.rows):
            return
        if self._filler is None:
            from concurrent.futures import ThreadPoolExecutor

            self._filler = ThreadPoolExecutor(1, thread_name_prefix="genq-masks")
        pool, words, rows = self._pool(), self.words, host.shape[0]
        future = self._filler.submit(fill_masks, pool, plan.matchers, host.data_ptr(), words, rows)
        self._ahead = (plan, future)
        self.start_s += time.perf_counter() - began

    def _settle(self) -> tuple[MaskRows, Any] | None:
        """The masks started ahead, once written (None: none were)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].result()
        return ahead

    def apply(self, logits: Any, active_jobs: Iterable[Any]) -> None:
        """Mask the constrained rows of `logits` (rows × 1 × vocabulary, on the device) in
        place. A pass that is not one decode position per row, or whose rows are not the
        plan's, is left alone: a token sampled there that the grammar refuses fails its job."""
        self.consume()
        started = time.perf_counter()
        ahead = self._settle()
        plan = constrained_rows(active_jobs)
        if not plan.rows or plan.total_rows != logits.shape[0] or logits.shape[1] != 1:
            return
        n = len(plan.rows)
        host, device = self._buffers(n, logits.device)
        if ahead is not None and _same(ahead[0], plan):
            self.prefetched += 1
        else:
            fill_masks(self._pool(), plan.matchers, host.data_ptr(), self.words, host.shape[0])
        masked = time.perf_counter()
        self.wait_s += masked - started
        device = device[:n]
        device.copy_(host[:n], non_blocking=True)
        blocked = self._blocked(device, logits.shape[-1])
        if n == plan.total_rows:
            logits[:, 0, :].masked_fill_(blocked, MASKED)
        else:
            self._mask_some(logits, plan.rows, blocked)
        self.masked_rows += n
        self.steps += 1
        done = time.perf_counter()
        self.launch_s += done - masked
        self.seconds += done - started

    def warm_up(self, logits: Any) -> None:
        """The masking's kernels once, every row and some rows of `logits` (rows × 1 ×
        vocabulary, on the device; overwritten), and llguidance's threads started: before the
        first constrained step, not during it. Counts nothing."""
        n = int(logits.shape[0])
        host, device = self._buffers(n, logits.device)
        host[:n].fill_(-1)  # every bit set: every token allowed
        self._pool()
        if self._filler is None:
            from concurrent.futures import ThreadPoolExecutor

            self._filler = ThreadPoolExecutor(1, thread_name_prefix="genq-masks")
        bits = device[:n]
        bits.copy_(host[:n], non_blocking=True)
        blocked = self._blocked(bits, logits.shape[-1])
        logits[:, 0, :].masked_fill_(blocked, MASKED)
        self._mask_some(logits, list(range(0, n, 2)), blocked[: (n + 1) // 2])

    def close(self) -> None:
        self._taken, self._taken_ids = [], set()
        self._settle()
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None

    def _pool(self) -> Any:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self.threads)
        return self._executor

    def _buffers(self, n: int, device: Any) -> tuple[Any, Any]:
        import torch

        if self._host is None or self._host.shape[0] < n:
            rows = max(n, 64 if self._host is None else 2 * self._host.shape[0])
            pinned = device.type == "cuda"
            self._host = torch.zeros((rows, self.words), dtype=torch.int32, pin_memory=pinned)
            self._device = torch.zeros((rows, self.words), dtype=torch.int32, device=device)
            self._shifts = torch.arange(8, dtype=torch.uint8, device=device)
        return self._host, self._device

    def _blocked(self, bits: Any, width: int) -> Any:
        """(n, width) bool, True where a token is not allowed; ids past the masks' words
        (a logits row wider than the vocabulary the matchers know) are blocked too."""
        import torch

        n = bits.shape[0]
        each = bits.view(torch.uint8)  # little-endian: bit i of a word is bit i % 8 of byte i // 8
        blocked = ((each.unsqueeze(-1) >> self._shifts) & 1).view(n, -1) == 0
        known = blocked.shape[1]
        if known >= width:
            return blocked[:, :width]
        return torch.cat([blocked, blocked.new_ones((n, width - known))], dim=1)

    def _mask_some(self, logits: Any, rows: list[int], blocked: Any) -> None:
        import torch

        index = torch.tensor(rows)
        if logits.is_cuda:  # through pinned memory: a pageable copy would wait for the pass
            index = index.pin_memory().to(logits.device, non_blocking=True)
        some = logits.index_select(0, index)
        some[:, 0, :].masked_fill_(blocked, MASKED)
        logits.index_copy_(0, index, some)


def warm_hook(gen: Any, rows: int, width: int) -> None:
    """genq's hook on `gen` (its edits and masks), run once over dummy logits of `rows` ×
    `width` in each dtype a model may give, on the GPU, before the worker reports ready;
    nothing without a GPU or without the hook."""
    edits, masks = getattr(gen, "genq_edits", None), getattr(gen, "genq_masks", None)
    if edits is None and masks is None:
        return
    import torch

    if not torch.cuda.is_available():
        return
    device = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float32, torch.float16):
        logits = torch.zeros((rows, 1, width), dtype=dtype, device=device)
        if edits is not None:
            edits.warm_up(logits)
        if masks is not None:
            masks.warm_up(logits)
    torch.cuda.synchronize(device)
