"""GPU tests: a tiny synth model on the real exllamav2 and exllamav3 engines (fp16, and an EXL3
conversion of it for exllamav3). Skipped without CUDA; an engine's tests are skipped without
its library."""

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
EXL3_TEST_BITS = 4.0
EXL3_MODELS = ["fp16", "exl3"]
"""The models the exllamav3 engine is tested on: the tiny synth model, and its EXL3 conversion."""


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
def tiny_exl3_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model converted to EXL3 (GENQ_TEST_TINY_EXL3_MODEL: one converted already)."""
    pytest.importorskip("exllamav3")
    from genq.synth import quantize_exl3

    given = os.environ.get("GENQ_TEST_TINY_EXL3_MODEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("models") / "tiny-exl3"
    return quantize_exl3(out, EXL3_TEST_BITS, tiny_model)


@pytest.fixture(scope="session", params=EXL3_MODELS)
def exl3_model(request: pytest.FixtureRequest, tiny_model: Path) -> Path:
    pytest.importorskip("exllamav3")
    if request.param == "fp16":
        return tiny_model
    return Path(request.getfixturevalue("tiny_exl3_model"))


@pytest.fixture(scope="session")
def exl3_engine(exl3_model: Path) -> Iterator[object]:
    from worker.exl3.engine import ExLlamaV3Engine

    settings = Settings(
        model_dir=str(exl3_model),
        engine="exllamav3",
        max_batch=TEST_BATCH,
        cache_tokens=TEST_CACHE_TOKENS,
        batched_sampling=False,  # exllamav3's own sampler; the batched pass has its fixture
    )
    e = ExLlamaV3Engine.from_settings(settings)
    yield e
    e.close()


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Iterator[object]:
    pytest.importorskip("exllamav2")
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
    logprobs: list[dict] = field(default_factory=list)


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
    res.logprobs += o.logprobs or []
    if o.finish_reason:
        res.finish = o.finish_reason
        res.prompt_tokens = o.prompt_tokens
    if o.error:
        res.error = o.error
