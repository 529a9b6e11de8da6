"""How far ahead of their slots batch claims start (worker/lead.py): the claims' measured way
in, in steps, plus one."""

from __future__ import annotations

from worker.lead import MAX_TOKENS, MIN_TOKENS, Lead


def test_the_lead_is_the_way_in_in_steps_plus_one() -> None:
    lead = Lead()
    lead.read(0.005)
    lead.started(0.070)
    assert lead.tokens(0.020) == 5  # 75 ms: four 20 ms steps, and the message's step


def test_the_lead_stays_between_its_bounds() -> None:
    lead = Lead()
    assert lead.tokens(0.020) == MIN_TOKENS  # nothing measured: the least
    assert lead.tokens(0.0) == MIN_TOKENS  # no step measured yet
    lead.started(0.001)
    assert lead.tokens(0.5) == MIN_TOKENS  # a fast way in, slow steps
    lead.started(10.0)
    lead.started(10.0)
    assert lead.tokens(0.020) == MAX_TOKENS  # a way in of seconds: no more than the most


def test_recent_starts_weigh_most() -> None:
    lead = Lead()
    lead.started(0.200)
    for _ in range(30):
        lead.started(0.010)
    assert lead.tokens(0.020) == 2  # one slow START long ago no longer counts


def test_a_flush_under_way_delays_what_the_worker_learns() -> None:
    lead = Lead()
    lead.started(0.030)
    without = lead.tokens(0.020)
    lead.flushed(0.060)  # outputs read up to 60 ms late: three steps more
    assert lead.tokens(0.020) == without + 3
