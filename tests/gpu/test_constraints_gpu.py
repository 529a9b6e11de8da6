"""Constrained jobs on the GPU engines (worker/dyngen/masks.py), on the tiny synth model: valid
JSON at a batch of 64 beside unconstrained jobs, on every sampling path each engine has (genq's
batched pass, exllamav2's CPU sampler, exllamav3's own); greedy output under a constraint that
admits it is the unconstrained output; a resumed job goes on inside its constraint."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer

from shared.constraints import grammar_of
from shared.settings import Settings
from tests.gpu.conftest import TEST_BATCH, TEST_CACHE_TOKENS, Outcome, drive
from tests.gpu.test_exl2_gpu import ejob, prompt
from worker.constraint import Grammars
from worker.engine import EngineJob

pytestmark = pytest.mark.gpu
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "pet": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"kind": {"enum": ["cat", "dog"]}},
                    "required": ["kind"],
                    "additionalProperties": False,
                },
            ]
        },
    },
    "required": ["name", "age", "tags", "ok", "pet"],
    "additionalProperties": False,
}
"""Every field bounded: the JSON ends within ~70 tokens whatever the random model picks."""
GRAMMAR = grammar_of("json_schema", SCHEMA)
ANYTHING = grammar_of("regex", r"(.|\n)*")
MAX_TOKENS = 128

ENGINES = {
    "exl2": {"engine": "exllamav2"},
    "exl2-cpu-sampler": {"engine": "exllamav2", "gpu_sampling": False},
    "exl3": {"engine": "exllamav3", "batched_sampling": True, "batched_sampling_min_jobs": 1},
    "exl3-own-sampler": {"engine": "exllamav3", "batched_sampling": False},
}
"""Each engine with genq's batched pass, and with its library's own sampler for every job."""


def load(tiny_model: Path, name: str) -> Any:
    pytest.importorskip("exllamav2" if name.startswith("exl2") else "exllamav3")
    from worker.exl2.engine import ExLlamaV2Engine
    from worker.exl3.engine import ExLlamaV3Engine

    opts = ENGINES[name]
    cls = ExLlamaV2Engine if opts["engine"] == "exllamav2" else ExLlamaV3Engine
    settings = Settings(
        model_dir=str(tiny_model), max_batch=TEST_BATCH, cache_tokens=TEST_CACHE_TOKENS, **opts
    )
    return cls.from_settings(settings)


@pytest.fixture(scope="module", params=list(ENGINES))
def each_engine(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Any]:
    e = load(tiny_model, request.param)
    yield e
    e.close()


@pytest.fixture(scope="module", params=["exl2", "exl3"])
def batched_engine(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Any]:
    e = load(tiny_model, request.param)
    yield e
    e.close()


def cjob(job_id: str, ids: list[int], grammar: str = GRAMMAR, **kw: Any) -> EngineJob:
    j = ejob(job_id, ids, **{"max_tokens": MAX_TOKENS, **kw})
    j.grammar = grammar
    return j


def valid(res: Outcome) -> Any:
    assert res.error is None, res.error
    assert res.finish == "stop", (res.finish, res.text)
    doc = json.loads(res.text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_constrained_jobs_give_valid_json_in_a_batch_of_64_beside_unconstrained_ones(
    each_engine: Any,
) -> None:
    """32 constrained jobs (neutral sampling, greedy, penalties, top logprobs: each engine's
    paths) and 32 unconstrained ones in one batch; two constrained jobs cut by max_tokens."""
    rng = random.Random(31)
    kinds: list[dict[str, Any]] = [
        {},
        {"temperature": 0.0},
        {"temperature": 0.8, "top_p": 0.9},
        {"repetition_penalty": 1.2, "presence_penalty": 0.3},
        {"logprobs": 2},
    ]
    constrained = [
        cjob(f"c{i}", prompt(rng, rng.randint(8, 200)), **kinds[i % len(kinds)]) for i in range(30)
    ]
    cut = [cjob(f"cut{i}", prompt(rng, 20), max_tokens=5) for i in range(2)]
    plain = [ejob(f"p{i}", prompt(rng, rng.randint(8, 200)), max_tokens=32) for i in range(32)]
    jobs = [j for pair in zip(constrained + cut, plain, strict=True) for j in pair]
    masks = each_engine._gen.genq_masks
    before = masks.masked_rows
    seen: list[int] = []
    out = drive(each_engine, jobs, on_step=lambda n: seen.append(each_engine.active()))
    assert max(seen) == 64
    for j in constrained:
        valid(out[j.id])
        if j.sampling.logprobs is not None:
            lps = out[j.id].logprobs
            assert len(lps) == len(out[j.id].token_ids)
            assert all(math.isfinite(e["logprob"]) for e in lps)  # the sampled: allowed
    grammars = Grammars(each_engine.tokenizer_json, each_engine.card.eos_token_ids)
    for j in cut:  # cut mid-JSON: finish length, and what there is starts a valid document
        res = out[j.id]
        assert res.error is None and res.finish == "length" and len(res.token_ids) == 5
        assert res.text.startswith("{")
        m = grammars.matcher(GRAMMAR, res.token_ids)  # raises if they left the schema
        assert not m.accepting
    for j in plain:
        res = out[j.id]
        assert res.error is None and res.finish in ("stop", "length")
        assert res.finish == "stop" or len(res.token_ids) == 32
    assert masks.masked_rows - before >= sum(len(out[j.id].token_ids) for j in constrained)


def test_greedy_under_a_constraint_that_admits_it_is_the_unconstrained_output(
    batched_engine: Any,
) -> None:
    """`(.|\\n)*` admits every token but the special ones and bytes that cannot start or
    continue UTF-8 there. In one batch, each prompt greedy, plain and constrained: the same
    tokens up to the first the regex refuses (to the end where it refuses none), then a
    different one."""
    rng = random.Random(32)
    prompts = [prompt(rng, rng.randint(8, 120)) for _ in range(8)]
    plain = [ejob(f"p{i}", p, max_tokens=48, temperature=0.0) for i, p in enumerate(prompts)]
    masked = [
        cjob(f"m{i}", p, grammar=ANYTHING, max_tokens=48, temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    out = drive(batched_engine, [*plain, *masked])
    card = batched_engine.card
    grammars = Grammars(batched_engine.tokenizer_json, card.eos_token_ids)
    whole = agreed = total = 0
    for p, m in zip(plain, masked, strict=True):
        a, b = out[p.id], out[m.id]
        assert a.error is None and b.error is None
        admitted = admitted_prefix(grammars, a.token_ids)
        assert b.token_ids[:admitted] == a.token_ids[:admitted]
        if admitted == len(a.token_ids):
            assert b.token_ids == a.token_ids and b.finish == a.finish and b.text == a.text
            whole += 1
        else:
            assert b.token_ids[admitted] != a.token_ids[admitted]
        agreed += admitted
        total += len(a.token_ids)
    assert whole >= 1 and agreed * 2 >= total, (whole, agreed, total)


def admitted_prefix(grammars: Grammars, token_ids: list[int]) -> int:
    """How many of `token_ids` `(.|\\n)*` takes before it refuses one."""
    m = grammars.matcher(ANYTHING)
    for i, t in enumerate(token_ids):
        if not m.consume(t):
            return i
    return len(token_ids)


def test_a_resumed_job_goes_on_inside_its_constraint(batched_engine: Any) -> None:
    """A job whose earlier attempt generated part of the JSON (cut at several points, mid-
    string among them) continues from there to a document that still fits the schema."""
    rng = random.Random(33)
    ids = prompt(rng, 60)
    first = drive(batched_engine, [cjob("r", ids, temperature=0.0)])["r"]
    valid(first)
    done = first.token_ids
    cuts = sorted({1, 4, len(done) // 2, len(done) - 2})
    jobs = []
    for k in cuts:
        j = cjob(f"r{k}", ids, temperature=0.7, max_tokens=MAX_TOKENS + k)
        j.resume_ids = done[:k]
        jobs.append(j)
    out = drive(batched_engine, jobs)
    tokenizer = Tokenizer.from_str(batched_engine.tokenizer_json)
    for k, j in zip(cuts, jobs, strict=True):
        res = out[j.id]
        assert res.error is None and res.finish == "stop"
        text = tokenizer.decode(done[:k] + res.token_ids)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_replay_that_leaves_the_constraint_fails_the_job_alone(batched_engine: Any) -> None:
    rng = random.Random(34)
    bad = cjob("bad", prompt(rng, 20))
    bad.resume_ids = prompt(rng, 3)  # random tokens: not the start of a JSON object
    with pytest.raises(ValueError, match="do not fit the constraint"):
        batched_engine.add(bad)
    ok = drive(batched_engine, [cjob("ok", prompt(rng, 20))])["ok"]
    valid(ok)
