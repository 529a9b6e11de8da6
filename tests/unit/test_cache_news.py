"""Cache news: what a worker's cache model tells (pages in and out between versions), how a
gateway keeps its copy in order whatever order the news comes in, and how it weighs a lane's
wait against the prefill a cached prefix saves."""

from __future__ import annotations

import math
from typing import Any

from gateway.placement import Placement, _Worker
from shared.keys import Keys
from shared.pages import PAGE_TOKENS, pack_summary, page_hashes
from shared.records import CacheNews, Heartbeat
from shared.schemas import JobSpec, Sampling
from shared.settings import Settings
from worker.cachemodel import CacheModel


def ids(n_pages: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_pages * PAGE_TOKENS))


def test_the_cache_model_tells_pages_taken_in_and_dropped_since_its_last_news() -> None:
    model = CacheModel(pages=3)
    assert model.touch(ids(2)) == 0
    first = model.take_news()
    assert first is not None and (first.since, first.version) == (0, 1)
    assert first.added == page_hashes(ids(2)) and first.dropped == []
    assert model.take_news() is None  # nothing since
    assert model.touch(ids(2)) == 2  # both pages there: the prefill it saves
    model.touch(ids(2, start=10_000))  # 4 pages in a cache of 3: the oldest goes
    news = model.take_news()
    assert news is not None and (news.since, news.version) == (1, 3)
    assert news.dropped == page_hashes(ids(2))[:1]
    assert page_hashes(ids(2))[0] not in news.added


def beat(worker: str, **load: Any) -> Heartbeat:
    fields: dict[str, Any] = {"capacity": 4, "active": 0, "free": 4, **load}
    return Heartbeat(
        worker_id=worker,
        model="sim",
        engine="sim",
        host="h",
        pid=1,
        version="0",
        tokens_per_s=0.0,
        started_at=0.0,
        **fields,
    )


def news(since: int, version: int, pages: list[int], seq: int) -> CacheNews:
    return CacheNews(worker="w", seq=seq, since=since, version=version, added=pack_summary(pages))


def test_news_that_overtakes_an_earlier_one_waits_for_it() -> None:
    w = _Worker(beat("w"))
    w.read(None, 0)
    a, b = page_hashes(ids(1)), page_hashes(ids(1, start=5000))
    w.hear(news(1, 2, b, seq=2))
    assert w.pages == set() and w.version == 0  # 0 -> 1 is missing: b waits
    w.hear(news(0, 1, a, seq=1))
    assert w.pages == {*a, *b} and w.version == 2


def test_a_summary_read_is_brought_up_to_date_by_the_news_heard_since() -> None:
    w = _Worker(beat("w"))
    a, b = page_hashes(ids(1)), page_hashes(ids(1, start=5000))
    w.hear(news(3, 4, b, seq=9))  # heard before the worker's summary was read
    w.read(pack_summary(a), 3)
    assert w.pages == {*a, *b} and w.version == 4


def test_a_summary_read_after_missed_news_applies_what_came_after_the_gap() -> None:
    """News 1 -> 2 was never heard (a reconnect): the summary (version 1, the last beat's)
    and news 2 -> 3, heard before the read, still make what the worker holds now, without
    waiting for the next beat to name a version past the gap."""
    w = _Worker(beat("w"))
    a, c = page_hashes(ids(1)), page_hashes(ids(1, start=9000))
    w.hear(news(2, 3, c, seq=3))
    w.version = -1  # a wake without news: read the summary again
    w.read(pack_summary(a), 1)
    assert w.pages == {*a, *c} and w.version == 3


def placement(**settings: Any) -> Placement:
    s = Settings(placement_wait_s=2.0, placement_sweep_s=0.1, **settings)
    return Placement(s, None, Keys(), lambda: None)  # type: ignore[arg-type]


def fleet(p: Placement, prompt: list[int], **holder_load: Any) -> tuple[_Worker, _Worker]:
    """A worker holding `prompt`'s pages (`holder_load`), and an idle one holding none; both
    prefill 10,000 tokens a second."""
    holder = _Worker(beat("holder", **{"prefill_tps": 10_000.0, "job_s": 1.0, **holder_load}))
    holder.read(pack_summary(page_hashes(prompt)), 1)
    other = _Worker(beat("other", prefill_tps=10_000.0, job_s=1.0))
    other.read(None, 0)
    p.workers = {"holder": holder, "other": other}
    return holder, other


def spec(prompt: list[int]) -> JobSpec:
    return JobSpec(
        id="j",
        model="sim",
        input_ids=prompt,
        max_tokens=4,
        sampling=Sampling(),
        priority="interactive",
        created_at=0.0,
    )


def test_a_job_waits_for_its_worker_only_while_that_beats_recomputing_it_elsewhere() -> None:
    p = placement(placement_max_load=2.0)  # a lane may hold as many as run: the bound allows
    prompt = ids(8)  # 2,048 tokens: 0.2 s of prefill saved
    fleet(p, prompt)  # the holder has room: the job goes there, waiting at most the bound
    d = p.decide(spec(prompt))
    assert d.outcome == "prefix" and d.lane is not None and d.wait_ms == 2000
    # Full, a slot frees every 1 s / 4 jobs = 0.25 s: longer than the prefill saved.
    fleet(p, prompt, active=4, free=0)
    assert p.decide(spec(prompt)).outcome == "shared"
    # Full, but its slots free up every 0.05 s: waiting pays, for 0.2 s at most.
    fleet(p, prompt, active=4, free=0, job_s=0.2)
    d = p.decide(spec(prompt))
    assert d.outcome == "prefix" and d.wait_ms is not None and 50 <= d.wait_ms <= 210


def test_a_placement_is_recorded_at_once_and_told_to_other_gateways() -> None:
    p = placement()
    prompt = ids(4)
    holder, _ = fleet(p, ids(2))  # holds half the prompt
    d = p.decide(spec(prompt))
    assert d.outcome == "prefix" and holder.placed == 1
    assert set(page_hashes(prompt)) <= holder.pages  # the next job with it follows
    told = CacheNews.decode(d.news)
    assert told.worker == "holder" and told.gateway == p.id and told.placed == 1
    other = placement()
    fleet(other, [])
    other.hear(d.news)
    assert other.workers["holder"].placed == 1
    assert set(page_hashes(prompt)) <= other.workers["holder"].pages
    p.hear(d.news)  # its own: recorded already
    assert holder.placed == 1


def test_on_an_engine_that_prefills_one_job_after_another_the_backlog_counts() -> None:
    p = placement()
    prompt = ids(8)  # 0.2 s of prefill saved on the holder
    fleet(p, prompt, prefill_serial=True, prefill_backlog=10_000)  # 1 s queued before it
    assert p.decide(spec(prompt)).outcome == "shared"
    holder, _ = fleet(p, prompt, prefill_serial=True, prefill_backlog=500)  # 0.05 s queued
    d = p.decide(spec(prompt))
    # it may wait until the idle worker, recomputing all 0.2 s, would have started it
    assert d.outcome == "prefix" and d.wait_ms is not None and 100 <= d.wait_ms <= 210
    assert holder.placed_tokens == 0  # all of it cached there: nothing more to prefill


def test_a_holder_beside_workers_whose_wait_is_unknown_places_without_an_error() -> None:
    """Early in a run the other workers are full and no job of theirs has ended yet: their
    wait is unknown (infinite). The holder, measured, prefilling one job after another, may
    keep the job for the bound; this used to raise OverflowError (int of infinity), a 500
    from POST /v1/jobs (3 processes on a GPU, placement on)."""
    p = placement()
    prompt = ids(8)
    _holder, other = fleet(p, prompt, prefill_serial=True, prefill_backlog=500)
    other.beat = beat("other", prefill_tps=10_000.0, active=4, free=0)
    other.take_load(other.beat)
    assert math.isinf(other.wait_s(10_000.0))
    d = p.decide(spec(prompt))
    assert d.outcome == "prefix" and d.lane is not None and d.wait_ms == 2000


def test_of_two_workers_holding_the_same_prefix_the_quicker_one_gets_the_job() -> None:
    """An agent's turns ran on two workers in turn: both hold the prompt's prefix, one
    prefills a little faster. The job goes to that one (it used to go to the shared queue:
    the first holder found was not where the job starts soonest, so it was not placed at all,
    and the shared queue sent it, one time in two here, to a worker holding nothing)."""
    p = placement()
    prompt = ids(8)
    chain = pack_summary(page_hashes(prompt[: 7 * PAGE_TOKENS]))
    slow = _Worker(beat("slow", prefill_tps=150_000.0, job_s=0.1))
    fast = _Worker(beat("fast", prefill_tps=155_000.0, job_s=0.1))
    idle = _Worker(beat("idle"))
    for w in (slow, fast):
        w.read(chain, 1)
    idle.read(None, 0)
    p.workers = {"slow": slow, "fast": fast, "idle": idle}
    d = p.decide(spec(prompt))
    assert d.outcome == "prefix" and d.lane is not None and d.lane.endswith(":fast")


def test_a_worker_holding_only_a_shared_system_prompt_gets_no_placed_job() -> None:
    """The worker holding the conversation is busy, so the job goes where it starts soonest;
    another worker holding only the system prompt every conversation shares is no reason to
    tie the job to its lane (the shared queue finds a free worker sooner: placing on such
    workers raised the multi-turn bench's TTFT p50 1.5x and left the workers 14 % apart)."""
    p = placement()
    prompt = ids(8)
    _holder, other = fleet(p, prompt, prefill_serial=True, prefill_backlog=10_000)
    other.read(pack_summary(page_hashes(prompt[:PAGE_TOKENS])), 1)  # the system prompt
    assert p.decide(spec(prompt)).outcome == "shared"
