"""GPU tests: a tiny synth model on the real exllamav2 engine. Skipped without CUDA."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.settings import Settings
from worker.engine import EngineJob, StepOutput

TEST_BATCH = 64
TEST_CACHE_TOKENS = 64 * 512
STEP_LIMIT = 20_000


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs torch with a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from genq.synth import synth_model

    given = os.environ.get("GENQ_TEST_TINY_MODEL")
    if given:
        return Path(given)
    return synth_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Iterator[object]:
    from worker.exl2.engine import ExLlamaV2Engine

    settings = Settings(
        model_dir=str(tiny_model),
        engine="exllamav2",
        max_batch=TEST_BATCH,
        cache_tokens=TEST_CACHE_TOKENS,
    )
    e = ExLlamaV2Engine.from_settings(settings)
    yield e
    e.close()


@dataclass
class Outcome:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    prompt_tokens: int = 0


def drive(engine, jobs: list[EngineJob], on_step=None) -> dict[str, Outcome]:  # type: ignore[no-untyped-def]
    """Add `jobs`, step until every one ended; what each produced."""
    out = {j.id: Outcome() for j in jobs}
    for j in jobs:
        engine.add(j)
    for n in range(STEP_LIMIT):
        if not engine.active():
            return out
        if on_step is not None:
            on_step(n)
        for o in engine.step():
            _collect(out[o.job_id], o)
    raise AssertionError("jobs did not finish")


def _collect(res: Outcome, o: StepOutput) -> None:
    res.text += o.text
    res.token_ids += o.token_ids
    if o.finish_reason:
        res.finish = o.finish_reason
        res.prompt_tokens = o.prompt_tokens
    if o.error:
        res.error = o.error
