"""The exllamav2 engine on a GPU, with a tiny random-weight Llama (`genq synth-model`)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import zlib
from pathlib import Path

import httpx
import pytest

from shared.schemas import Sampling
from shared.settings import Settings
from tests.gpu.conftest import drive
from tests.prefixes import test_prefix
from tests.procs import Cluster
from worker.admission import Admission
from worker.engine import EngineJob
from worker.text import Detokenizer

pytestmark = pytest.mark.gpu
MAX_TOKENS = 32
VOCAB_LOW, VOCAB_HIGH = 300, 4000


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def ejob(
    job_id: str, ids: list[int], max_tokens: int = MAX_TOKENS, **sampling: object
) -> EngineJob:
    seed = zlib.crc32(job_id.encode()) & 0xFFFF  # not hash(): a str's changes with each process
    return EngineJob(job_id, ids, max_tokens, Sampling(**sampling), seed=seed)


def test_64_concurrent_jobs_finish_with_the_right_token_counts(engine) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1)
    jobs = [ejob(f"j{i}", prompt(rng, rng.randint(8, 400))) for i in range(64)]
    seen_batch = []
    out = drive(engine, jobs, on_step=lambda n: seen_batch.append(engine.active()))
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


def test_greedy_output_is_the_same_alone_and_in_a_full_batch(engine) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(2)
    ids = prompt(rng, 100)
    alone = drive(engine, [ejob("g", ids, temperature=0.0)])["g"]
    others = [ejob(f"o{i}", prompt(rng, rng.randint(8, 300))) for i in range(63)]
    batched = drive(engine, [*others[:31], ejob("g", ids, temperature=0.0), *others[31:]])["g"]
    assert alone.token_ids and batched.token_ids == alone.token_ids
    assert batched.text == alone.text


def test_stop_string_ends_the_job_before_it(engine) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    ids = prompt(rng, 50)
    full = drive(engine, [ejob("s0", ids, temperature=0.0)])["s0"]
    text = full.text
    assert len(text) > 20
    stop = text[10:14]
    cut = text.index(stop)
    res = drive(engine, [ejob("s1", ids, temperature=0.0, stop=[stop])])["s1"]
    assert res.finish == "stop"
    assert res.text == text[:cut]


def test_stop_token_id_ends_the_job(engine) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(4)
    ids = prompt(rng, 50)
    full = drive(engine, [ejob("t0", ids, temperature=0.0)])["t0"]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    res = drive(engine, [ejob("t1", ids, temperature=0.0, stop_token_ids=[stop_id])])["t1"]
    assert res.finish == "stop" and res.token_ids == full.token_ids[:first]


def check_sampler_extensions(engine) -> None:  # type: ignore[no-untyped-def]
    """logit_bias bans and forces tokens, min_tokens holds stop tokens back, banned_strings
    never appear: greedy jobs against the engine's own greedy text."""
    ids = prompt(random.Random(6), 50)
    full = drive(engine, [ejob("x0", ids, temperature=0.0)])["x0"]
    first, other = full.token_ids[0], full.token_ids[3]
    assert len(full.token_ids) > 5 and len(full.text) > 20 and other != first
    # four letters the greedy text holds (a random model's text has partial characters,
    # shown as U+FFFD, which a banned string cannot name)
    word = next(w for i in range(len(full.text)) if (w := full.text[i : i + 4]).isalpha())
    out = drive(
        engine,
        [
            ejob("ban", ids, temperature=0.0, logit_bias={str(first): -100.0}),
            ejob("force", ids, 8, temperature=0.0, logit_bias={str(other): 100.0}),
            ejob("min", ids, temperature=0.0, stop_token_ids=[first], min_tokens=5),
            ejob("words", ids, temperature=0.0, banned_strings=[word.upper()]),
        ],
    )
    assert out["ban"].token_ids and out["ban"].token_ids[0] != first
    assert out["force"].token_ids == [other] * 8
    held = out["min"].token_ids  # without min_tokens: no token at all (its first is the stop)
    assert len(held) >= 5 and first not in held[:5]
    assert word.lower() not in out["words"].text.lower()


def test_logit_bias_min_tokens_and_banned_strings_reach_exllamav2(engine) -> None:  # type: ignore[no-untyped-def]
    check_sampler_extensions(engine)


def test_cancel_returns_the_free_pages_to_the_baseline(engine) -> None:  # type: ignore[no-untyped-def]
    baseline = engine.free_pages()
    rng = random.Random(5)
    jobs = [ejob(f"c{i}", prompt(rng, 300), max_tokens=200) for i in range(16)]
    for j in jobs:
        engine.add(j)
    for _ in range(5):
        engine.step()
    assert engine.free_pages() < baseline
    assert all(engine.cancel(j.id) for j in jobs)
    assert engine.active() == 0
    assert engine.free_pages() == baseline


def test_admission_follows_the_generators_pages(engine) -> None:  # type: ignore[no-untyped-def]
    total, page = engine.total_pages, engine.page_size

    def admission() -> Admission:  # as the worker holds it after the engine's last report
        return Admission(engine.max_batch, page, total, engine.free_pages())

    assert admission().fits(total * page, active=0)
    rng = random.Random(6)
    big = ejob("big", prompt(rng, engine.card.max_seq_len - 64), max_tokens=64)
    assert admission().fits(engine.card.max_seq_len, active=0)
    engine.add(big)
    assert not admission().fits(total * page, active=1)
    assert engine.cancel("big")


def test_a_cache_smaller_than_the_prefill_chunk_loads_and_runs(tiny_model: Path) -> None:
    """The GPU benchmark at 1 stream (cache 768 tokens, chunk 2,048) crashed at load."""
    from worker.exl2.engine import ExLlamaV2Engine

    settings = Settings(
        model_dir=str(tiny_model), engine="exllamav2", max_batch=1, cache_tokens=768
    )
    small = ExLlamaV2Engine.from_settings(settings)
    try:
        ids = prompt(random.Random(9), 600)
        res = drive(small, [ejob("long", ids, max_tokens=100)])["long"]
        assert res.error is None and res.prompt_tokens == 600 and res.token_ids
    finally:
        small.close()


def test_text_made_by_the_worker_is_the_engines(engine, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    """GENQ_DETOKENIZE=worker: the text made from the token ids (DecodeStream) and the stop
    strings matched there give what the engine itself gives."""
    rng = random.Random(10)
    ids = prompt(rng, 40)
    ref = drive(engine, [ejob("e0", ids, max_tokens=64, temperature=0.0)])["e0"]
    stop = ref.text[20:23]
    with_stop = drive(engine, [ejob("e1", ids, max_tokens=64, temperature=0.0, stop=[stop])])
    detok = Detokenizer((tiny_model / "tokenizer.json").read_text())
    for stops, want in (([], ref), ([stop], with_stop["e1"])):
        j = ejob("w", ids, max_tokens=64, temperature=0.0, stop=stops)
        j.text = False
        stream = detok.stream(stops, ids, [])
        text, kept = [], []
        engine.add(j)
        while engine.active() and not stream.done:
            for o in engine.step():
                t, keep = stream.feed(o.token_ids, o.finish_reason is not None)
                text.append(t)
                kept += o.token_ids[:keep]
        engine.cancel("w")
        assert "".join(text) == want.text
        assert kept == want.token_ids or stops  # a stop string keeps the token that ended it


def test_a_job_larger_than_the_cache_is_refused_clearly(engine) -> None:  # type: ignore[no-untyped-def]
    limit = engine.card.max_seq_len
    with pytest.raises(ValueError, match="over this worker's limit"):
        engine.add(ejob("huge", [400] * limit, max_tokens=16))
    assert engine.active() == 0


def test_logprobs_come_back(engine) -> None:  # type: ignore[no-untyped-def]
    engine.add(ejob("lp", prompt(random.Random(7), 20), max_tokens=4, logprobs=3))
    outs = []
    while engine.active():
        outs += engine.step()
    entries = [e for o in outs if o.logprobs for e in o.logprobs]
    assert len(entries) == sum(len(o.token_ids) for o in outs) > 0
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 3 for e in entries)


# ---- the whole path ------------------------------------------------------------------------


def test_gateway_to_worker_to_sse_with_the_real_engine(tiny_model: Path, tmp_path: Path) -> None:
    import os

    redis_url = os.environ.get("GENQ_REDIS_URL", "redis://127.0.0.1:6379/0")
    cluster = Cluster(redis_url, tmp_path, test_prefix("gpu"))
    try:
        gw = cluster.gateway()
        cluster.worker(
            "--model",
            str(tiny_model),
            "--max-batch",
            "16",
            "--cache-tokens",
            "8192",
            wait_model=tiny_model.name,
        )
        card = httpx.get(f"{gw.url}/v1/models").json()["data"]
        assert any(m["id"] == tiny_model.name for m in card)
        body = {
            "model": tiny_model.name,
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

        too_long = {"model": tiny_model.name, "input_ids": [400] * 9000, "max_tokens": 8}
        r = httpx.post(f"{gw.url}/v1/jobs", json=too_long, timeout=10)
        assert r.status_code == 400 and "maximum context length" in r.text
    finally:
        cluster.close()


def test_synth_model_cli(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "genq", "synth-model", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()).joinpath("config.json").exists()
