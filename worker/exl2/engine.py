"""The engine: exllamav2's `ExLlamaV2DynamicGenerator` behind `DynamicEngine`
(worker/dyngen/engine.py: cancel, and generator steps → StepOutputs).

exllamav2 names every result's job by the `identifier` genq gives it (the job id); its
generator exposes its pages directly (`page_size`, `max_pages`, `unreferenced_pages`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from worker.dyngen.engine import DynamicEngine
from worker.dyngen.results import step_output
from worker.engine import StepOutput
from worker.exl2.loader import SAMPLING_SUPPORT, load_backend

if TYPE_CHECKING:
    from shared.settings import EngineSettings

log = logging.getLogger(__name__)


class ExLlamaV2Engine(DynamicEngine):
    sampling_support = SAMPLING_SUPPORT

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> ExLlamaV2Engine:
        return cls(*load_backend(settings))

    @property
    def page_size(self) -> int:
        return int(self._gen.page_size)

    @property
    def total_pages(self) -> int:
        return int(self._gen.max_pages)

    @property
    def gpu_sampler(self) -> Any:
        """The current generator's `gpu_sampling.GpuSampler` (its counters), or None."""
        return getattr(self._gen, "genq_sampler", None)

    def _unreferenced_pages(self) -> int:
        return len(self._gen.unreferenced_pages)

    def _token_limit(self) -> int:
        return min(int(self._gen.max_seq_len), self.total_pages * self.page_size)

    def _enqueue(self, handle: Any, job_id: str) -> Hashable:
        self._gen.enqueue(handle)
        return job_id

    def _result(self, r: dict[str, Any]) -> StepOutput | None:
        if r.get("stage") != "streaming":
            return None
        job_id = r.get("identifier")
        tracked = self._jobs.get(job_id) if isinstance(job_id, str) else None
        if tracked is None:
            return None
        if r.get("eos"):
            self._forget(tracked)
        return step_output(r, tracked.job, tracked.prompt_tokens, self._backend.piece)
