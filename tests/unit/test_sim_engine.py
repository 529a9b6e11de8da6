"""The sim engine: deterministic, honest about limits, stop strings and continuation."""

from __future__ import annotations

import time

import pytest

from shared.schemas import Sampling
from worker.admission import Admission
from worker.engine import EngineJob, StepOutput
from worker.sim import SimEngine


def _engine(**kw: object) -> SimEngine:
    options: dict = {"step_ms": 0, "prefill_ms_per_1k": 0}
    options.update(kw)
    return SimEngine(**options)


def _job(job_id: str = "j", max_tokens: int = 20, seed: int = 1, **sampling: object) -> EngineJob:
    return EngineJob(job_id, [5, 6, 7], max_tokens, Sampling(**sampling), seed)


def _run(engine: SimEngine, *jobs: EngineJob) -> dict[str, list[StepOutput]]:
    for j in jobs:
        engine.add(j)
    out: dict[str, list[StepOutput]] = {j.id: [] for j in jobs}
    while engine.active():
        for o in engine.step():
            out[o.job_id].append(o)
    return out


def _text(outs: list[StepOutput]) -> str:
    return "".join(o.text for o in outs)


def test_same_request_same_tokens_and_seed_matters() -> None:
    a = _run(_engine(), _job("a", seed=1))["a"]
    b = _run(_engine(), _job("b", seed=1))["b"]
    c = _run(_engine(), _job("c", seed=2))["c"]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert _text(a) != _text(c)


def test_greedy_ignores_seed() -> None:
    a = _run(_engine(), _job("a", seed=1, temperature=0))["a"]
    b = _run(_engine(), _job("b", seed=2, temperature=0))["b"]
    assert _text(a) == _text(b)


def test_max_tokens_and_finish_reason() -> None:
    outs = _run(_engine(), _job(max_tokens=7))["j"]
    assert sum(len(o.token_ids) for o in outs) == 7
    assert outs[-1].finish_reason == "length"
    assert all(o.finish_reason is None for o in outs[:-1])


def test_text_decodes_the_emitted_tokens() -> None:
    e = _engine()
    outs = _run(e, _job(max_tokens=15))["j"]
    ids = [t for o in outs for t in o.token_ids]
    assert e._tokenizer.decode(ids) == _text(outs)


def test_stop_string_ends_the_job_and_is_never_emitted() -> None:
    reference = _text(_run(_engine(), _job(max_tokens=40))["j"])
    words = reference.split()
    stop = f"{words[5]} {words[6][:2]}"  # spans a token boundary
    outs = _run(_engine(), _job(max_tokens=40, stop=[stop]))["j"]
    text = _text(outs)
    assert outs[-1].finish_reason == "stop"
    assert stop not in text
    assert reference.startswith(text) and reference[len(text) :].startswith(stop)


def test_stop_token_id() -> None:
    first = _run(_engine(), _job(max_tokens=10))["j"]
    third = first[2].token_ids[0]
    outs = _run(_engine(), _job(max_tokens=10, stop_token_ids=[third]))["j"]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].token_ids == [third] and len(outs) <= 3


def _ids(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_logit_bias_bans_and_forces_words() -> None:
    plain = _ids(_run(_engine(), _job(max_tokens=40))["j"])
    common = max(set(plain), key=plain.count)
    banned = _ids(_run(_engine(), _job(max_tokens=40, logit_bias={str(common): -100.0}))["j"])
    assert common not in banned and len(banned) == 40 and banned != plain
    forced = _ids(_run(_engine(), _job(max_tokens=8, logit_bias={str(plain[1]): 100.0}))["j"])
    assert forced == [plain[1]] * 8
    eos = _engine().card.eos_token_ids[0]  # no word: a bias on it changes nothing
    assert _ids(_run(_engine(), _job(max_tokens=40, logit_bias={str(eos): 100.0}))["j"]) == plain


def test_min_tokens_holds_back_stop_tokens_until_then() -> None:
    seed, plain = next(
        (seed, ids)
        for seed in range(1, 100)
        if (ids := _ids(_run(_engine(), _job(max_tokens=60, seed=seed))["j"])).count(ids[0]) > 1
    )
    stop, again = plain[0], plain.index(plain[0], 1)  # the first token comes back at `again`
    early = _run(_engine(), _job(max_tokens=60, seed=seed, stop_token_ids=[stop]))["j"]
    assert _ids(early) == [stop] and early[-1].finish_reason == "stop"
    held = _run(_engine(), _job(max_tokens=60, seed=seed, stop_token_ids=[stop], min_tokens=again))[
        "j"
    ]
    ids = _ids(held)
    assert len(ids) == again + 1 and stop not in ids[:again] and ids[again] == stop
    assert held[-1].finish_reason == "stop" and ids[1:] == plain[1 : again + 1]


def test_banned_strings_never_appear_whatever_their_case() -> None:
    plain = _text(_run(_engine(), _job(max_tokens=40))["j"])
    words = plain.split()
    banned = f"{words[3][-2:]} {words[4][:2]}".upper()  # spans a token boundary
    text = _text(_run(_engine(), _job(max_tokens=40, banned_strings=[banned]))["j"])
    assert banned.lower() in plain.lower() and banned.lower() not in text.lower()
    assert len(text.split()) == 40
    [end] = _run(_engine(), _job(max_tokens=40, banned_strings=[" "]))["j"]
    assert end.finish_reason == "stop" and not end.token_ids  # every word starts with a space


def test_resumed_job_continues_exactly() -> None:
    whole = _run(_engine(), _job(max_tokens=12))["j"]
    ids = [o.token_ids[0] for o in whole]
    resumed = _job(max_tokens=12)
    resumed.resume_ids = ids[:5]
    rest = _run(_engine(), resumed)["j"]
    assert [o.token_ids[0] for o in rest] == ids[5:]
    assert _text(whole[:5]) + _text(rest) == _text(whole)


def test_batch_limit_and_context_limit() -> None:
    e = _engine(max_batch=2, max_seq_len=100)
    a = Admission(e.max_batch, e.page_size, e.total_pages, e.free_pages())
    assert a.fits(50, 1) and not a.fits(50, 2)
    assert a.fits(101, 0)  # admitted, then refused by `add` with a reason: never stuck waiting
    with pytest.raises(ValueError, match="over this engine's max_seq_len of 100"):
        e.add(EngineJob("big", [1] * 60, 41, Sampling(), 0))
    assert e.active() == 0
    assert e.card.simulated and "not a language model" in e.card.description


def test_step_time_is_per_batch_not_per_job() -> None:
    e = _engine(step_ms=20)
    for i in range(50):
        e.add(_job(str(i), max_tokens=3))
    t0 = time.monotonic()
    while e.active():
        e.step()
    assert time.monotonic() - t0 < 0.5  # 3 steps of 20 ms, not 150


def test_prefill_delay_grows_with_prompt() -> None:
    e = _engine(prefill_ms_per_1k=100)
    long = EngineJob("long", list(range(2000)), 1, Sampling(), 0)
    e.add(long)
    t0 = time.monotonic()
    while e.active():
        e.step()
    assert time.monotonic() - t0 >= 0.19


def test_cancel_and_reset() -> None:
    e = _engine()
    e.add(_job("a"))
    e.add(_job("b"))
    assert e.cancel("a") and not e.cancel("a")
    assert e.reset() == ["b"] and e.active() == 0


def test_logprobs_when_asked() -> None:
    outs = _run(_engine(), _job(max_tokens=3, logprobs=2))["j"]
    assert all(o.logprobs and len(o.logprobs[0]["top_logprobs"]) == 2 for o in outs)


def test_step_ms_0_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """As fast as it can: a sleep(0) per step cost ~80 us on Linux (timer slack), more than
    the step itself at 40 jobs."""
    import worker.sim as sim

    def no_sleep(_: float) -> None:
        raise AssertionError("slept")

    e = _engine(step_ms=0)
    e.add(_job(max_tokens=3))
    monkeypatch.setattr(sim.time, "sleep", no_sleep)
    while e.active():
        e.step()
