"""One list of sampler settings (`shared.schemas.SAMPLING_FIELDS`): each setting reaches the job
from both APIs and crosses to the engine process, and every engine maps it to its library or
names it refused. A setting added to `Sampling` fails here until it is given a probe value
below and every engine's `SamplingSupport` names it."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.openai.protocol import AS_IS, ChatCompletionRequest, CompletionRequest
from gateway.openai.serving import _job_body, plan
from shared.schemas import SAMPLING_DEFAULTS, SAMPLING_FIELDS, JobCreate, Sampling
from worker.core import AddCommand, EngineCore
from worker.dyngen.batch_pass import RowParams
from worker.engine import EngineJob, SamplingSupport
from worker.exl2 import gpu_sampling
from worker.exl2.engine import ExLlamaV2Engine
from worker.exl2.loader import job_fields, sampler_fields
from worker.exl3 import batch_sampling
from worker.exl3.engine import ExLlamaV3Engine
from worker.exl3.sampling import combo_args
from worker.sim import SimEngine, _job_base
from worker.wire import Frames, add_message, engine_job, frame, to_engine

PROBES: dict[str, Any] = {
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 7,
    "stop": ["END"],
    "stop_token_ids": [5],
    "logprobs": 2,
    "logit_bias": {"5": -100.0},
    "min_tokens": 2,
    "banned_strings": ["no"],
}
"""A value off its default for every sampler setting (a new setting needs one here)."""


def probe(name: str) -> Sampling:
    return Sampling(**{name: PROBES[name]})


def test_every_setting_has_a_probe_off_its_default() -> None:
    assert set(PROBES) == set(SAMPLING_FIELDS), "give each new Sampling field a probe value"
    for name in SAMPLING_FIELDS:
        assert probe(name).changed() == [name]


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_each_setting_reaches_the_job_from_both_apis_and_crosses_to_the_engine(name: str) -> None:
    value = PROBES[name]
    native = JobCreate(model="m", prompt="hi", **{name: value})
    assert getattr(Sampling.of(native), name) == value

    req = CompletionRequest(model="m", prompt="hi", **{name: value})
    p = plan(req)
    body = _job_body(req, "hi", p.max_tokens, p.logprobs, p.prompt_param, "interactive")
    assert getattr(Sampling.of(body), name) == value

    job = EngineJob("j", [1, 2], 8, probe(name), seed=3)
    [add] = Frames(to_engine).feed(frame(add_message(job, attempt=1)))
    assert getattr(engine_job(add).sampling, name) == value


def test_chat_takes_every_setting_it_carries_as_is() -> None:
    fields = {name: PROBES[name] for name in AS_IS}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    body = _job_body(req, "hi", None, None, "messages", "interactive")
    assert {name: getattr(body, name) for name in AS_IS} == fields


ENGINES: dict[str, tuple[SamplingSupport, Callable[[Sampling], Any]]] = {
    "sim": (
        SimEngine.sampling_support,
        lambda s: _job_base(EngineJob("j", [1, 2, 3], 8, s, seed=1)),
    ),
    "exl2": (ExLlamaV2Engine.sampling_support, sampler_fields),
    "exl3": (ExLlamaV3Engine.sampling_support, combo_args),
}
"""Each engine's table and its sampler mapping (what its library is given for a `Sampling`)."""


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_names_every_setting(engine: str) -> None:
    support, _ = ENGINES[engine]
    assert not support.missing, (
        f"the {engine} engine neither maps nor refuses {sorted(support.missing)}: "
        "map it to the library (its SamplingSupport.sampler or .elsewhere) or refuse it"
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_each_setting_an_engine_maps_changes_what_its_library_gets(engine: str) -> None:
    support, mapping = ENGINES[engine]
    neutral = mapping(Sampling())
    unchanged = [name for name in sorted(support.sampler) if mapping(probe(name)) == neutral]
    assert not unchanged, f"{engine}'s sampler mapping ignores {unchanged}"


def test_the_batched_passes_leave_every_other_setting_to_the_librarys_sampler() -> None:
    """exllamav3's batched pass and exllamav2's GPU sampling apply temperature, top_k, top_p
    and min_p alone: a job setting anything else that changes the draw (a penalty, logprobs,
    any new setting) is sampled by the library."""
    applied = {"temperature", "top_k", "top_p", "min_p"}
    beside = {"seed", "stop", "stop_token_ids"}  # the job's RNG and stop conditions
    assert batch_sampling.PASS_APPLIES == applied and batch_sampling.PASS_LEAVES == beside
    for name in SAMPLING_FIELDS:
        s = probe(name)
        row = batch_sampling.row_params(s)
        if name in applied | beside:
            assert row == RowParams(s.temperature, s.top_k, s.top_p, s.min_p)
        else:
            assert row is None, name
    for name in set(SAMPLING_FIELDS) - applied - beside - {"logprobs"}:
        assert gpu_sampling.job_params(_exl2_job(probe(name))) is None, name


def _exl2_job(s: Sampling) -> SimpleNamespace:
    """An exllamav2 job as `make_job` makes one for `s` (`token_bias`: a stand-in tensor)."""
    settings = SimpleNamespace(**sampler_fields(s), post_sampling_hooks=[])
    if s.logit_bias:
        settings.token_bias = object()
    return SimpleNamespace(
        sequences=[object()],
        filters=[],
        prefix_token=None,
        return_top_tokens=0,
        return_logits=False,
        gen_settings=settings,
        **job_fields(s),
    )


def test_a_refused_setting_fails_its_job_alone_naming_it() -> None:
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0)
    sim = SimEngine.sampling_support
    engine.sampling_support = SamplingSupport(
        sampler=sim.sampler,
        elsewhere={k: v for k, v in sim.elsewhere.items() if k != "logprobs"},
        refused=frozenset({"logprobs"}),
    )
    core = EngineCore(engine)
    [out] = core.apply([AddCommand(EngineJob("a", [5, 6], 4, probe("logprobs"), 1), 1)])
    assert out.job_id == "a" and out.error is not None and "logprobs" in out.error
    assert core.apply([AddCommand(EngineJob("b", [5, 6], 4, Sampling(), 1), 1)]) == []
    assert engine.active() == 1


def test_a_table_naming_no_setting_or_one_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="top_kk"):
        SamplingSupport(sampler=frozenset({"top_kk"}), elsewhere={})
    with pytest.raises(ValueError, match="seed"):
        SamplingSupport(sampler=frozenset({"seed"}), elsewhere={"seed": "twice"})


def test_defaults_are_the_models_own() -> None:
    assert SAMPLING_DEFAULTS == Sampling().model_dump()
