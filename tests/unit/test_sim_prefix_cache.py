"""The sim engine's prefix cache: whole leading pages found by their hash chain, no prefill
time for them, reported as cached tokens; a reply's pages cached for the next turn; LRU."""

from __future__ import annotations

import time

from shared.pages import PAGE_TOKENS, page_hashes, shared_pages
from shared.schemas import Sampling
from worker.engine import EngineJob, StepOutput
from worker.sim import SimEngine


def run(engine: SimEngine, job_id: str, ids: list[int], max_tokens: int = 4) -> list[StepOutput]:
    engine.add(EngineJob(job_id, ids, max_tokens, Sampling(), seed=1))
    outs: list[StepOutput] = []
    while engine.active():
        outs += engine.step()
    return outs


def test_page_chain_names_prefixes() -> None:
    a = list(range(3 * PAGE_TOKENS + 10))
    b = a[: 2 * PAGE_TOKENS] + [7] * PAGE_TOKENS
    assert len(page_hashes(a)) == 3 and page_hashes(a)[:2] == page_hashes(b)[:2]
    assert page_hashes(a)[2] != page_hashes(b)[2]
    assert shared_pages(page_hashes(b), set(page_hashes(a))) == 2
    assert page_hashes(list(range(PAGE_TOKENS - 1))) == []


def test_cached_pages_cost_no_prefill_and_are_reported() -> None:
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=200.0, cache_tokens=8 * PAGE_TOKENS)
    history = [5 + i % 300 for i in range(4 * PAGE_TOKENS)]
    t0 = time.monotonic()
    first = run(engine, "a", history)
    cold = time.monotonic() - t0
    assert first[-1].cached_tokens == 0
    t0 = time.monotonic()
    again = run(engine, "b", [*history, 9, 9, 9])
    warm = time.monotonic() - t0
    assert again[-1].cached_tokens == 4 * PAGE_TOKENS
    assert cold > 0.15 and warm < cold / 3


def test_a_reply_is_cached_for_the_next_turn_and_old_pages_age_out() -> None:
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0, cache_tokens=2 * PAGE_TOKENS)
    prompt = [5] * (PAGE_TOKENS + 100)
    outs = run(engine, "t1", prompt, max_tokens=PAGE_TOKENS)
    reply = [t for o in outs for t in o.token_ids]
    turn2 = run(engine, "t2", [*prompt, *reply, 8, 8])
    assert turn2[-1].cached_tokens == 2 * PAGE_TOKENS  # the prompt's page and the reply's
    run(engine, "other", [6] * (2 * PAGE_TOKENS))  # fills the cache: the old pages go
    assert run(engine, "t3", [*prompt, *reply, 8, 8])[-1].cached_tokens == 0


def test_chunked_prefill_runs_one_job_after_another_and_holds_up_the_step() -> None:
    """GENQ_SIM_PREFILL_CHUNK_TOKENS: a GPU's prefill. A short prompt queued behind a long one
    waits for it, and a running job's next token waits for the step's prefill."""
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=200.0, prefill_chunk_tokens=PAGE_TOKENS)
    assert not engine.prefill_side_by_side
    engine.add(EngineJob("running", [5] * 10, 100, Sampling(), seed=1))
    while not engine.step():  # its prefill, then its first token
        pass
    engine.add(EngineJob("long", [6] * (4 * PAGE_TOKENS), 4, Sampling(), seed=1))
    engine.add(EngineJob("short", [7] * 10, 4, Sampling(), seed=1))
    firsts: dict[str, float] = {}
    t0 = time.monotonic()
    gaps: list[float] = []
    while len(firsts) < 2:
        before = time.monotonic()
        outs = engine.step()
        if any(o.job_id == "running" for o in outs):
            gaps.append(time.monotonic() - before)
        for o in outs:
            if o.token_ids and o.job_id in ("long", "short"):
                firsts.setdefault(o.job_id, time.monotonic() - t0)
    assert firsts["long"] <= firsts["short"]  # first come, first prefilled
    assert firsts["short"] >= 4 * PAGE_TOKENS * 0.0002  # behind ~0.2 s of the long one's
    assert max(gaps) >= PAGE_TOKENS * 0.0002 * 0.9  # a chunk of 256 tokens in a step
    side = SimEngine(step_ms=0, prefill_ms_per_1k=200.0)
    assert side.prefill_side_by_side
