"""The exllamav3 engine on a GPU: the tiny synth model in fp16 and converted to EXL3 (each test
runs on both, `exl3_engine[fp16]` / `[exl3]`), then the whole path with a real worker."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.model_format import folder_format
from shared.schemas import Sampling
from shared.settings import Settings
from tests.gpu.conftest import EXL3_TEST_BITS, TEST_CACHE_TOKENS, drive
from tests.gpu.test_exl2_gpu import MAX_TOKENS, check_sampler_extensions, ejob, prompt
from tests.prefixes import test_prefix
from tests.procs import Cluster, wait_for
from worker.admission import Admission
from worker.engine import EngineJob, reserved_tokens
from worker.exl3.sampling import combo_args

pytestmark = pytest.mark.gpu
WORKER_READY_S = 300.0
"""Loading, warm-up and (on a cold Triton cache) kernel compilation before the card shows."""


def test_64_concurrent_jobs_finish_with_the_right_token_counts(exl3_engine: Any) -> None:
    rng = random.Random(1)
    jobs = [ejob(f"j{i}", prompt(rng, rng.randint(8, 400))) for i in range(64)]
    seen_batch: list[int] = []
    out = drive(exl3_engine, jobs, on_step=lambda n: seen_batch.append(exl3_engine.active()))
    assert max(seen_batch) == 64
    for j in jobs:
        res = out[j.id]
        assert res.error is None
        assert res.prompt_tokens == len(j.input_ids)
        if res.finish == "length":
            assert len(res.token_ids) == MAX_TOKENS
        else:  # the random model sampled an EOS token: ended early, EOS not output
            assert res.finish == "stop" and len(res.token_ids) < MAX_TOKENS
    assert sum(r.finish == "length" for r in out.values()) >= 48


NEAR_TIE_NATS = 0.05
"""Top two log-probabilities closer than this are a near-tie. exllamav3's quantized matmul
takes another kernel for one row than for 64 (other rounding), so on random weights an
argmax that close may flip between alone and in a batch: seen once in 256 tokens."""


def test_greedy_output_is_the_same_alone_and_in_a_full_batch(exl3_engine: Any) -> None:
    """Same tokens alone and among 63 others; where they part, only at a near-tie of the
    alone run, to its second choice (after that the contexts differ). A batch that mixed up
    another job's pages or sampler would part at a clear choice."""
    rng = random.Random(2)
    ids = prompt(rng, 100)
    alone = drive(exl3_engine, [ejob("g", ids, temperature=0.0, logprobs=2)])["g"]
    others = [ejob(f"o{i}", prompt(rng, rng.randint(8, 300))) for i in range(63)]
    job = ejob("g", ids, temperature=0.0, logprobs=2)
    batched = drive(exl3_engine, [*others[:31], job, *others[31:]])["g"]
    if parts_at_a_near_tie(alone, batched.token_ids) is None:
        assert batched.text == alone.text


def parts_at_a_near_tie(ref: Any, got: list[int]) -> int | None:
    """Where greedy `got` parts from greedy `ref` (an Outcome with top-2 logprobs), None if
    it does not; asserts that it parts only at a near-tie of `ref`, to its second choice."""
    a = ref.token_ids
    assert a and len(ref.logprobs) == len(a)
    parted = next((i for i, (x, y) in enumerate(zip(a, got, strict=False)) if x != y), None)
    if parted is None:
        assert got == a
        return None
    first, second = ref.logprobs[parted]["top_logprobs"][:2]
    assert first["token_id"] == a[parted]
    assert got[parted] == second["token_id"], f"token {parted} parted to a third choice"
    assert first["logprob"] - second["logprob"] < NEAR_TIE_NATS, (
        f"token {parted} parted at a clear choice: {first} against {second}"
    )
    return parted


def test_stop_string_ends_the_job_before_it(exl3_engine: Any) -> None:
    rng = random.Random(3)
    ids = prompt(rng, 50)
    full = drive(exl3_engine, [ejob("s0", ids, temperature=0.0)])["s0"]
    text = full.text
    assert len(text) > 20
    stop = text[10:14]
    cut = text.index(stop)
    res = drive(exl3_engine, [ejob("s1", ids, temperature=0.0, stop=[stop])])["s1"]
    assert res.finish == "stop"
    assert res.text == text[:cut]


def test_stop_token_id_ends_the_job(exl3_engine: Any) -> None:
    rng = random.Random(4)
    ids = prompt(rng, 50)
    full = drive(exl3_engine, [ejob("t0", ids, temperature=0.0)])["t0"]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    res = drive(exl3_engine, [ejob("t1", ids, temperature=0.0, stop_token_ids=[stop_id])])["t1"]
    assert res.finish == "stop" and res.token_ids == full.token_ids[:first]


def test_logit_bias_min_tokens_and_banned_strings_reach_exllamav3(exl3_engine: Any) -> None:
    check_sampler_extensions(exl3_engine)


def test_cancel_returns_the_free_pages_to_the_baseline(exl3_engine: Any) -> None:
    baseline = exl3_engine.free_pages()
    rng = random.Random(5)
    jobs = [ejob(f"c{i}", prompt(rng, 300), max_tokens=200) for i in range(16)]
    for j in jobs:
        exl3_engine.add(j)
    outs = [o for _ in range(5) for o in exl3_engine.step()]
    assert exl3_engine.free_pages() < baseline
    assert [o.error for o in outs if o.error] == []
    # a job of the random model may sample EOS in its first tokens: it has ended by itself
    ended = {o.job_id for o in outs if o.finish_reason}
    assert len(ended) < len(jobs) // 2
    cancelled = [exl3_engine.cancel(j.id) for j in jobs if j.id not in ended]  # every one
    assert all(cancelled)
    assert exl3_engine.active() == 0
    assert exl3_engine.free_pages() == baseline
    assert admission(exl3_engine).fits(exl3_engine.total_pages * exl3_engine.page_size - 1, 0)


def unwrapped(model: Any) -> Any:
    """The model under genq's hook (`batch_sampling._SamplingModel`), if it is wrapped."""
    return getattr(model, "_model", model)


def admission(engine: Any) -> Admission:  # as the worker holds it after the engine's last report
    return Admission(
        engine.max_batch,
        engine.page_size,
        engine.total_pages,
        engine.free_pages(),
        reserved_tokens(engine),
    )


def test_admission_follows_the_generators_pages(exl3_engine: Any) -> None:
    whole = exl3_engine.total_pages * exl3_engine.page_size - 1  # exllamav3 keeps one token
    assert admission(exl3_engine).fits(whole, active=0)
    assert reserved_tokens(exl3_engine) == 1
    rng = random.Random(6)
    big = ejob("big", prompt(rng, exl3_engine.card.max_seq_len - 64), max_tokens=64)
    exl3_engine.add(big)
    assert not admission(exl3_engine).fits(whole, active=1)
    assert exl3_engine.cancel("big")


def test_a_job_larger_than_the_cache_is_refused_before_it_is_queued(exl3_engine: Any) -> None:
    limit = exl3_engine.card.max_seq_len
    with pytest.raises(ValueError, match="over this worker's limit"):
        exl3_engine.add(ejob("huge", [400] * limit, max_tokens=16))
    assert exl3_engine.active() == 0
    assert not exl3_engine._gen.pending_jobs and not exl3_engine._gen.active_jobs


def test_max_new_tokens_reaches_exllamav3_uncapped(exl3_engine: Any) -> None:
    exl3_engine.add(ejob("n", prompt(random.Random(8), 20), max_tokens=123))
    [tracked] = exl3_engine._jobs.values()
    assert tracked.handle.max_new_tokens == 123
    assert exl3_engine.cancel("n")


def test_the_engine_keeps_torch_to_the_threads_its_settings_name(exl3_engine: Any) -> None:
    import torch

    assert torch.get_num_threads() == 1  # GENQ_TORCH_THREADS' default


def test_logprobs_come_back(exl3_engine: Any) -> None:
    exl3_engine.add(ejob("lp", prompt(random.Random(7), 20), max_tokens=4, logprobs=3))
    outs = []
    while exl3_engine.active():
        outs += exl3_engine.step()
    entries = [e for o in outs if o.logprobs for e in o.logprobs]
    assert len(entries) == sum(len(o.token_ids) for o in outs) > 0
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 3 for e in entries)
    for e in entries:  # the model's own distribution: the top entries in order, below 1 in sum
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)


@pytest.fixture(scope="module")
def exl3_batched(exl3_model: Path) -> Any:
    """The engine with GENQ_BATCHED_SAMPLING on (worker/exl3/batch_sampling.py), in passes of
    any size (GENQ_BATCHED_SAMPLING_MIN_JOBS=1: the counts below are the pass's alone)."""
    from worker.exl3.engine import ExLlamaV3Engine

    settings = Settings(
        model_dir=str(exl3_model),
        engine="exllamav3",
        max_batch=64,
        cache_tokens=TEST_CACHE_TOKENS,
        batched_sampling=True,
        batched_sampling_min_jobs=1,
    )
    e = ExLlamaV3Engine.from_settings(settings)
    yield e
    e.close()


def test_batched_sampling_takes_every_plain_token_after_the_first(exl3_batched: Any) -> None:
    """64 jobs, a quarter with penalties and a quarter with logprobs (exllamav3's own sampler):
    every job ends with the right counts, and the batched pass sampled exactly the plain and
    greedy jobs' tokens after each one's first (the first goes through exllamav3's NaN check)."""
    rng = random.Random(21)
    kinds = [{}, {"temperature": 0.0}, {"presence_penalty": 0.5}, {"logprobs": 2}]
    jobs = [ejob(f"b{i}", prompt(rng, rng.randint(8, 300)), **kinds[i % 4]) for i in range(64)]
    sampler = exl3_batched.batch_sampler
    before = sampler.batched_tokens
    out = drive(exl3_batched, jobs)
    served = 0
    for i, j in enumerate(jobs):
        res = out[j.id]
        assert res.error is None
        if res.finish == "length":
            assert len(res.token_ids) == MAX_TOKENS
            sampled = MAX_TOKENS
        else:  # an EOS token, sampled but not output
            assert res.finish == "stop" and len(res.token_ids) < MAX_TOKENS
            sampled = len(res.token_ids) + 1
        if i % 4 < 2:
            served += sampled - 1
    assert sampler.batched_tokens - before == served > 0


def test_passes_smaller_than_the_threshold_leave_the_jobs_to_their_own_samplers(
    exl3_batched: Any,
) -> None:
    """With the default threshold (16 jobs), four plain jobs are sampled by exllamav3's own
    sampler alone; 32 by the pass (from each one's second token); every job ends cleanly."""
    sampler = exl3_batched.batch_sampler
    sampler.min_jobs = Settings().batched_sampling_min_jobs
    try:
        rng = random.Random(24)
        for n, batched in ((4, False), (32, True)):
            jobs = [ejob(f"t{n}-{i}", prompt(rng, rng.randint(8, 100))) for i in range(n)]
            before = sampler.batched_tokens
            out = drive(exl3_batched, jobs)
            assert all(
                out[j.id].error is None and out[j.id].finish in ("stop", "length") for j in jobs
            )
            assert (sampler.batched_tokens > before) is batched
    finally:
        sampler.min_jobs = 1


def test_batched_greedy_is_exllamav3s_greedy(exl3_engine: Any, exl3_batched: Any) -> None:
    """The same argmax as exllamav3's own sampler, alone and in a batch of 64; where they
    part, only at a near-tie (see the greedy test above)."""
    rng = random.Random(22)
    ids = prompt(rng, 100)
    ref = drive(exl3_engine, [ejob("g", ids, temperature=0.0, logprobs=2)])["g"]
    others = [ejob(f"o{i}", prompt(rng, rng.randint(8, 300))) for i in range(63)]
    for jobs in ([ejob("g", ids, temperature=0.0)], [*others, ejob("g", ids, temperature=0.0)]):
        parts_at_a_near_tie(ref, drive(exl3_batched, jobs)["g"].token_ids)


def test_a_seeded_job_repeats_itself_under_batched_sampling(exl3_batched: Any) -> None:
    ids = prompt(random.Random(23), 40)
    job = ejob("s", ids, top_p=0.9)
    runs = [drive(exl3_batched, [job])["s"].token_ids for _ in range(2)]
    reseeded = EngineJob("s", ids, MAX_TOKENS, job.sampling, seed=job.seed + 1)
    assert runs[0] == runs[1] and len(runs[0]) > 1
    assert drive(exl3_batched, [reseeded])["s"].token_ids != runs[0]  # the seed repeats it


def describe(sampler: Any) -> list[tuple[str, dict[str, Any]]]:
    """A sampler's steps and their settings (what decides how it samples)."""
    plain = (int, float, bool, str, type(None))
    return [
        (type(step).__name__, {k: v for k, v in vars(step).items() if isinstance(v, plain)})
        for step in sampler.steps
    ]


SAMPLINGS = [
    Sampling(),
    Sampling(temperature=0.0),
    Sampling(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    Sampling(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_each_job_gets_exactly_the_sampler_genq_asked_for(
    exl3_engine: Any, sampling: Sampling
) -> None:
    from exllamav3 import ComboSampler, DefaultSampler

    handle = exl3_engine._backend.make_job([300, 301], 4, sampling, 1, [], "sampler")
    assert type(handle.sampler) is ComboSampler
    assert describe(handle.sampler) == describe(ComboSampler(**combo_args(sampling)))
    assert describe(handle.sampler) != describe(DefaultSampler())  # the comparison can fail


def test_a_failed_step_rebuilds_the_generator_over_the_same_cache(exl3_engine: Any) -> None:
    old = exl3_engine._gen
    ids = prompt(random.Random(9), 40)
    before = drive(exl3_engine, [ejob("r0", ids, temperature=0.0)])["r0"]
    exl3_engine.add(ejob("r1", ids, temperature=0.0))

    def broken() -> list[dict[str, Any]]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    old.iterate = broken
    with pytest.raises(RuntimeError):
        exl3_engine.step()
    assert exl3_engine.reset() == ["r1"]
    new = exl3_engine._gen
    assert new is not old and new.cache is old.cache
    assert unwrapped(new.model) is unwrapped(old.model)  # each generator wraps it in genq's hook
    after = drive(exl3_engine, [ejob("r2", ids, temperature=0.0)])["r2"]
    assert after.token_ids == before.token_ids


# ---- the whole path ------------------------------------------------------------------------


def test_gateway_to_worker_to_sse_with_the_real_engine(exl3_model: Path, tmp_path: Path) -> None:
    """The worker picks exllamav3 for the EXL3 folder by itself; fp16 is named."""
    redis_url = os.environ.get("GENQ_REDIS_URL", "redis://127.0.0.1:6379/0")
    cluster = Cluster(redis_url, tmp_path, test_prefix("gpu3"))
    engine = [] if folder_format(exl3_model) == "exl3" else ["--engine", "exllamav3"]
    try:
        gw = cluster.gateway()
        args = ["--model", str(exl3_model), "--max-batch", "16", "--cache-tokens", "8192"]
        worker = cluster.worker(*engine, *args, wait_model=None)
        wait_for(
            lambda: any(
                m["id"] == exl3_model.name for m in httpx.get(f"{gw.url}/v1/models").json()["data"]
            ),
            timeout=WORKER_READY_S,
            what=f"the exllamav3 worker: {worker.output()[-2000:]}",
        )
        body = {
            "model": exl3_model.name,
            "prompt": "def main():\n    return",
            "max_tokens": 24,
            "stream": True,
            "temperature": 0,
        }
        with httpx.stream("POST", f"{gw.url}/v1/jobs", json=body, timeout=60) as r:
            assert r.status_code == 200
            raw = r.read().decode()
        frames = [f for f in raw.split("\n\n") if "data: " in f]
        types = [f.split("event: ", 1)[1].split("\n", 1)[0] for f in frames]
        assert types[0] == "queued" and types[-1] == "done" and "token" in types
        data = [json.loads(f.split("data: ", 1)[1]) for f in frames]
        tokens = sum(d["count"] for d, t in zip(data, types, strict=True) if t == "token")
        done = data[-1]
        assert done["usage"]["completion_tokens"] == tokens
        assert done["finish_reason"] in ("length", "stop")
        if done["finish_reason"] == "length":
            assert tokens == 24

        too_long = {"model": exl3_model.name, "input_ids": [400] * 9000, "max_tokens": 8}
        r = httpx.post(f"{gw.url}/v1/jobs", json=too_long, timeout=10)
        assert r.status_code == 400 and "maximum context length" in r.text
    finally:
        cluster.close()


def test_a_random_trellis_model_loads_and_generates(tmp_path: Path) -> None:
    """`genq synth-model --quantize exl3 --random-trellis` (the 8B EXL3 benchmark's model):
    exllamav3 loads every projection as EXL3 and generates with finite log-probabilities."""
    import math

    from genq.synth import synth_model

    pytest.importorskip("exllamav3")  # a GPU machine that carries exllamav2 alone
    from worker.exl3.engine import ExLlamaV3Engine

    model = synth_model(tmp_path / "tiny-rt", "tiny", exl3_bits=EXL3_TEST_BITS)
    assert folder_format(model) == "exl3"
    settings = Settings(
        model_dir=str(model), engine="exllamav3", max_batch=8, cache_tokens=TEST_CACHE_TOKENS
    )
    e = ExLlamaV3Engine.from_settings(settings)
    try:
        rng = random.Random(5)
        jobs = [ejob(f"r{i}", prompt(rng, rng.randint(8, 200)), logprobs=1) for i in range(8)]
        out = drive(e, jobs)
    finally:
        e.close()
    for j in jobs:
        res = out[j.id]
        assert res.error is None and res.token_ids, res
        assert len(res.logprobs) == len(res.token_ids)
        assert all(math.isfinite(lp["logprob"]) for lp in res.logprobs)
