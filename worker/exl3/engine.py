"""The engine: exllamav3's `Generator` behind `DynamicEngine` (worker/dyngen/engine.py:
cancel, and generator steps → StepOutputs).

Besides what `DynamicEngine` uses, it talks to the generator through `close`, its
`pagetable`'s `max_pages` and `num_unreferenced_pages()`, so CPU tests drive it with a fake
generator. Every result names its job by the serial `enqueue` returned (an `error` result
carries no identifier), so jobs are keyed by serial.

Admission is the worker's (worker/admission.py), against the pages this engine reports:
free = unreferenced pages (those holding a reusable prompt prefix count: the generator evicts
them when it needs the room) less what jobs waiting in the generator will take when they
start; exllamav3 holds one token more per job than prompt + max new (`reserved_tokens`). A
job that could never fit is refused in `add()` before anything is enqueued: left to
exllamav3, it fails an assertion in `enqueue`, or with no `max_new_tokens` runs to the end of
the cache.

A failed `iterate()` leaves no job's state trustworthy: `reset()` closes that generator and
builds a new one over the same model and cache (no reload); the runner fails its jobs, and
the worker hands them back to the queue for another attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from worker.dyngen.backend import PAGE_TOKENS
from worker.dyngen.engine import DynamicEngine
from worker.engine import StepOutput
from worker.exl3.loader import RESERVED_TOKENS, load_backend
from worker.exl3.results import error_output, streaming_output
from worker.exl3.sampling import SAMPLING_SUPPORT

if TYPE_CHECKING:
    from shared.settings import EngineSettings

log = logging.getLogger(__name__)


class ExLlamaV3Engine(DynamicEngine):
    sampling_support = SAMPLING_SUPPORT

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> ExLlamaV3Engine:
        return cls(*load_backend(settings))

    @property
    def page_size(self) -> int:
        return PAGE_TOKENS

    @property
    def total_pages(self) -> int:
        return int(self._gen.pagetable.max_pages)

    @property
    def reserved_tokens(self) -> int:
        return RESERVED_TOKENS

    @property
    def batch_sampler(self) -> Any:
        """The current generator's `batch_sampling.BatchSampler` (its counters), or None."""
        return getattr(self._gen, "genq_sampler", None)

    def _unreferenced_pages(self) -> int:
        return int(self._gen.pagetable.num_unreferenced_pages())

    def _token_limit(self) -> int:
        return min(self.card.max_seq_len, self.total_pages * PAGE_TOKENS - RESERVED_TOKENS)

    def _enqueue(self, handle: Any, job_id: str) -> Hashable:
        return int(self._gen.enqueue(handle))

    def _result(self, r: dict[str, Any]) -> StepOutput | None:
        serial = r.get("serial")
        tracked = self._jobs.get(serial) if isinstance(serial, int) else None
        if tracked is None:
            return None
        stage = r.get("stage")
        if stage == "error":
            self._forget(tracked)
            return error_output(r, tracked.job)
        if stage != "streaming":
            return None
        if r.get("eos"):
            self._forget(tracked)
        return streaming_output(r, tracked.job, tracked.prompt_tokens, self._backend.piece)

    def _drop_generator(self) -> None:
        try:
            self._gen.close()
        except Exception:  # a broken generator's buffers: the new one does not need them
            log.exception("closing the failed exllamav3 generator failed")

    def _close_generator(self) -> None:
        self._gen.close()
