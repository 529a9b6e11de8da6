"""`worker.exl3.loader.load_backend` against a stand-in exllamav3 package (the real one needs
CUDA): what it builds, with which arguments, in which order — the cache before the weights
load (exllamav3 allocates it during `model.load`), the model's warm-up before any generator,
dummy jobs through the first generator, and the model card."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from shared.schemas import Sampling
from shared.settings import Settings
from tests.unit.test_exl3_engine import FakeComboSampler, FakeGenerator, FakeJob
from worker.exl3 import batch_sampling, loader

VOCAB = 4096
LOGITS = 4224
"""The model's logits width (its vocabulary rows): wider than the tokenizer's."""
EOS_ID = 2


def stand_in(events: list[tuple[Any, ...]]) -> types.ModuleType:
    """An `exllamav3` module with the classes and signatures load_backend uses."""
    ex = types.ModuleType("exllamav3")

    class Config:
        max_position_embeddings = 4096
        eos_token_id_list = [EOS_ID]
        vocab_size = LOGITS

        @staticmethod
        def from_directory(directory: str) -> Config:
            events.append(("config", directory))
            return Config()

    class CacheLayer_fp16:
        pass

    class CacheLayer_quant:
        pass

    class Cache:
        def __init__(
            self,
            model: Model,
            max_num_tokens: int,
            layer_type: type | None = None,
            max_batch_size: int = 16,
            **kwargs: Any,
        ) -> None:
            assert layer_type is not None
            events.append(("cache", max_num_tokens, layer_type.__name__, max_batch_size, kwargs))
            self.max_num_tokens = max_num_tokens
            self.initialized = False
            model.caches.append(self)

    class Model:
        def __init__(self) -> None:
            self.caches: list[Cache] = []

        @staticmethod
        def from_config(config: Config) -> Model:
            return Model()

        def load_gen(
            self,
            device: Any = None,
            use_per_device: Any = None,
            progressbar: bool = False,
            max_chunk_size: int = 2048,
            max_output_size: int = 32,
            max_batch_size: int = 1,
            generator: bool = True,
        ) -> None: ...

        def load(self, *args: Any, **kwargs: Any) -> None:
            events.append(("load", kwargs))
            for c in self.caches:
                c.initialized = True

        def warmup(
            self, cache: Any = None, max_chunk_size: int = 2048, max_batch_size: int = 8
        ) -> list[str]:
            events.append(("warmup", max_chunk_size, max_batch_size))
            return []

        def unload(self) -> None:
            events.append(("unload",))

    class Tokenizer:
        actual_vocab_size = VOCAB

        @staticmethod
        def from_config(config: Config) -> Tokenizer:
            return Tokenizer()

        def get_id_to_piece_list(self, include_special_tokens: bool = False) -> list[str]:
            return [f"p{i}" for i in range(VOCAB)]

    class Job(FakeJob):
        def __init__(
            self,
            input_ids: Any,
            max_new_tokens: int | None = None,
            min_new_tokens: int = 0,
            sampler: Any = None,
            seed: int | None = None,
            stop_conditions: Any = None,
            decode_special_tokens: bool = False,
            return_top_tokens: int = 0,
            return_probs: bool = False,
            identifier: Any = None,
            token_healing: bool = False,
            banned_strings: Any = None,
            max_rq_tokens: int | None = None,
            stop_on_loop: Any = None,
            **kwargs: Any,
        ) -> None:
            assert max_new_tokens is not None
            [ids] = input_ids
            script = list(range(300, 300 + max_new_tokens))
            super().__init__(ids, max_new_tokens, sampler, seed or 0, [], identifier, script)

    class Generator(FakeGenerator):
        def __init__(
            self,
            model: Model,
            cache: Cache,
            tokenizer: Tokenizer,
            max_batch_size: int = 256,
            max_chunk_size: int = 2048,
            shared_chunk_size: int | None = None,
            prefill_cooldown: int | None = 4,
            max_q_size: int = 8,
            **kwargs: Any,
        ) -> None:
            assert cache.initialized, "Construct the Cache BEFORE calling model.load()"
            events.append(("generator", max_chunk_size, shared_chunk_size, prefill_cooldown))
            super().__init__(cache.max_num_tokens // loader.PAGE_TOKENS, max_batch_size)
            self.model, self.tokenizer = model, tokenizer
            self.enqueued = 0

        def enqueue(self, job: FakeJob) -> int:
            self.enqueued += 1
            return super().enqueue(job)

    for cls in (Config, Cache, CacheLayer_fp16, CacheLayer_quant, Model, Tokenizer, Job):
        setattr(ex, cls.__name__, cls)
    ex.ComboSampler = FakeComboSampler  # type: ignore[attr-defined]
    ex.Generator = Generator  # type: ignore[attr-defined]
    return ex


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    log: list[tuple[Any, ...]] = []
    torch = types.ModuleType("torch")
    torch.long = "long"  # type: ignore[attr-defined]
    torch.tensor = lambda data, dtype=None: data  # type: ignore[attr-defined]
    torch.threads = []  # type: ignore[attr-defined]
    torch.set_num_threads = torch.threads.append  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(is_available=lambda: False)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "exllamav3", stand_in(log))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("TRITON_CACHE_DIR", "the environment's")  # restored after the test
    return log


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny-exl3"
    d.mkdir()
    qc = {"quant_method": "exl3", "bits": 4.0}
    (d / "config.json").write_text(json.dumps({"eos_token_id": EOS_ID, "quantization_config": qc}))
    (d / "tokenizer.json").write_text('{"model": {}}')
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


def settings(model_dir: Path, **overrides: Any) -> Settings:
    base = {"model_dir": str(model_dir), "max_batch": 8, "cache_tokens": 8192}
    return Settings(**(base | overrides))


def test_torch_keeps_to_the_threads_the_settings_name(
    events: list[tuple[Any, ...]], model_dir: Path
) -> None:
    """torch's default pool (a thread per CPU) spinning beside the kernel-launching thread
    made a 64-stream exllamav3 step 75 ms instead of 43 on an H200 (docs/performance.md)."""
    loader.load_backend(settings(model_dir))
    loader.load_backend(settings(model_dir, torch_threads=4))
    assert sys.modules["torch"].threads == [1, 4]  # type: ignore[attr-defined]


def test_the_cache_comes_before_the_weights_and_the_warm_up_before_generators(
    events: list[tuple[Any, ...]], model_dir: Path
) -> None:
    backend, card, tokenizer_json = loader.load_backend(settings(model_dir, prefill_cooldown=3))
    kinds = [e[0] for e in events]
    assert kinds == ["config", "cache", "load", "warmup", "generator"]
    assert events[1][1:4] == (8192, "CacheLayer_fp16", 8)
    assert events[2][1] == {
        "max_chunk_size": 2048,
        "max_batch_size": 8,
        "max_output_size": 8,
        "progressbar": False,
    }
    assert events[4][1:] == (2048, 2048, 3)
    warmed = backend.make_generator()
    # each size 1..8 (max_batch), 8 neutral jobs, a burst of 8, the long prefill: all run to
    # the end before ready
    assert warmed.enqueued == sum(range(1, 9)) + 8 + 8 + 1
    assert not warmed.num_remaining_jobs()
    assert backend.make_generator() is not warmed  # later ones are new, over the same cache
    assert card.engine == "exllamav3" and card.max_seq_len == 4096
    assert card.eos_token_ids == [EOS_ID] and card.max_batch == 8
    assert tokenizer_json == '{"model": {}}'
    assert backend.piece(5) == "p5" and backend.piece(VOCAB) == ""
    backend.close()
    assert events[-1] == ("unload",)
    assert os.environ["TRITON_CACHE_DIR"] == "the environment's"  # not set: left alone


def test_a_quantized_cache_and_a_gpu_split(events: list[tuple[Any, ...]], model_dir: Path) -> None:
    loader.load_backend(settings(model_dir, cache_mode="Q6", gpu_split="20,24"))
    assert events[1][2] == "CacheLayer_quant" and events[1][4] == {"k_bits": 6, "v_bits": 6}
    assert events[2][1]["use_per_device"] == [20.0, 24.0]


def test_the_triton_cache_is_set_before_exllamav3_loads(
    events: list[tuple[Any, ...]], model_dir: Path, tmp_path: Path
) -> None:
    kernels = tmp_path / "kernels"
    loader.load_backend(settings(model_dir, triton_cache_dir=str(kernels)))
    assert os.environ["TRITON_CACHE_DIR"] == str(kernels) and kernels.is_dir()


def test_batched_sampling_hooks_every_generator_and_marks_the_jobs_it_serves(
    events: list[tuple[Any, ...]], model_dir: Path
) -> None:
    batch_sampling.job_class.cache_clear()  # the stand-in's Job, not another test's
    try:
        backend, _, _ = loader.load_backend(settings(model_dir, batched_sampling=True))
        for gen in (backend.make_generator(), backend.make_generator()):  # warmed, then new
            assert isinstance(gen.genq_sampler, batch_sampling.BatchSampler)
            assert gen.genq_sampler.min_jobs == 16  # GENQ_BATCHED_SAMPLING_MIN_JOBS's default
            assert isinstance(gen.model, batch_sampling._SamplingModel)
        plain = backend.make_job([5, 6], 4, Sampling(), 0, [], "a")
        penalised = backend.make_job([5, 6], 4, Sampling(presence_penalty=0.5), 0, [], "b")
        assert isinstance(plain, sys.modules["exllamav3"].Job)
        assert plain.genq_params == batch_sampling.row_params(Sampling())
        assert penalised.genq_params is None
    finally:
        batch_sampling.job_class.cache_clear()


def test_without_batched_sampling_every_job_keeps_its_own_sampler_and_constraints_hold(
    events: list[tuple[Any, ...]], model_dir: Path
) -> None:
    """The hook stays on every generator, masking alone (constrained jobs' rows, over the
    model's logits width), and no job is marked for the batched pass."""
    batch_sampling.job_class.cache_clear()
    try:
        backend, _, _ = loader.load_backend(settings(model_dir, batched_sampling=False))
        for gen in (backend.make_generator(), backend.make_generator()):  # warmed, then new
            assert not hasattr(gen, "genq_sampler")
            assert isinstance(gen.model, batch_sampling._SamplingModel)
            assert gen.genq_masks.vocab_size == LOGITS == backend.vocab_size
        job = backend.make_job([5, 6], 4, Sampling(), 0, [], "a")
        assert isinstance(job, sys.modules["exllamav3"].Job) and job.genq_params is None
    finally:
        batch_sampling.job_class.cache_clear()


def test_the_batched_pass_takes_its_smallest_batch_from_the_settings(
    events: list[tuple[Any, ...]], model_dir: Path
) -> None:
    batch_sampling.job_class.cache_clear()
    try:
        ask = settings(model_dir, batched_sampling=True, batched_sampling_min_jobs=3)
        backend, _, _ = loader.load_backend(ask)
        assert backend.make_generator().genq_sampler.min_jobs == 3
    finally:
        batch_sampling.job_class.cache_clear()
