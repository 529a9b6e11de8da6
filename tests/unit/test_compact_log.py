"""The compact form of an ended job's log (shared/compact.py) replays, after any seq, what the
whole log holds after it: the same text, ids, logprobs and other events, across attempts."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from shared import events
from shared.compact import CompactLog
from shared.events import DoneEvent, Event, QueuedEvent, StartedEvent, TokenEvent
from shared.records import RecordError
from shared.schemas import JobResult, Timings, Usage

PAGE_BYTES = 64
"""Small: a replay comes in several pages."""


def log_of(*evs: Event) -> list[tuple[str, dict[str, str]]]:
    return [(f"0-{e.seq}", {"d": events.encode(e)}) for e in evs]


def two_attempts(logprobs: bool) -> list[tuple[str, dict[str, str]]]:
    """queued, attempt 1 (started, 3 token events), attempt 2 (started, 4 more), done."""
    seq = itertools.count(1)
    out: list[Event] = [
        QueuedEvent(seq=next(seq), id="j", model="m", priority="batch", prompt_tokens=2)
    ]
    word = 0
    for attempt, n in ((1, 3), (2, 4)):
        out.append(StartedEvent(seq=next(seq), attempt=attempt, worker=f"w{attempt}"))
        for _ in range(n):
            ids = [word, word + 1]
            lps = [{"token": str(i), "logprob": -1.0 * i} for i in ids] if logprobs else None
            text = f" wörd{word} 🙂{word + 1}"
            out.append(
                TokenEvent(
                    seq=next(seq), attempt=attempt, text=text, token_ids=ids, count=2, logprobs=lps
                )
            )
            word += 2
    usage, timings = Usage(completion_tokens=word), Timings()
    out.append(
        DoneEvent(seq=next(seq), attempt=2, finish_reason="stop", usage=usage, timings=timings)
    )
    return log_of(*out)


def fold(items: list[tuple[int, str, int, str]]) -> dict[str, Any]:
    evs = [events.decode(data) for _, _, _, data in items]
    tokens = [e for e in evs if isinstance(e, TokenEvent)]
    return {
        "text": "".join(e.text for e in tokens),
        "ids": [i for e in tokens for i in e.token_ids],
        "count": sum(e.count for e in tokens),
        "logprobs": [x for e in tokens for x in e.logprobs or []],
        "others": [events.encode(e) for e in evs if not isinstance(e, TokenEvent)],
        "attempts": sorted({(e.attempt, e.type) for e in evs}),
    }


def paged(log: CompactLog, after: int, result: JobResult | None) -> list[Any]:
    """Every page after `after`, each resumed from the last seq of the one before."""
    out: list[Any] = []
    while True:
        items, more = log.replay(after, result, max_bytes=PAGE_BYTES, max_events=2)
        out += items
        if not more:
            return out
        after = items[-1][0]


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("with_result", [False, True])
def test_a_replay_after_any_seq_is_what_the_log_holds_after_it(
    logprobs: bool, with_result: bool
) -> None:
    entries = two_attempts(logprobs)
    whole = [events.decode(f["d"]) for _, f in entries]
    tokens = [e for e in whole if isinstance(e, TokenEvent)]
    result = JobResult(
        text="".join(e.text for e in tokens), token_ids=[i for e in tokens for i in e.token_ids]
    )
    log = CompactLog.decode(CompactLog.of(entries, result if with_result else None).encode())
    assert (log.text is None) == with_result  # the result holds the text: not kept twice
    for after in range(len(entries) + 1):
        want = [(e.seq, e.type, e.attempt, events.encode(e)) for e in whole if e.seq > after]
        got = paged(log, after, result if with_result else None)
        assert fold(got) == fold(want), after
        assert [s for s, *_ in got] == sorted({s for s, *_ in got})
        assert all(s > after for s, *_ in got)


def test_a_result_that_differs_from_the_log_keeps_the_logs_text() -> None:
    entries = two_attempts(False)
    other = JobResult(text="something else", token_ids=[1])
    log = CompactLog.of(entries, other)
    items, _ = log.replay(0, other, max_bytes=10_000, max_events=100)
    assert "something else" not in fold(items)["text"]
    assert fold(items)["text"].startswith(" wörd0 🙂1")


def test_a_damaged_compact_log_is_a_record_error() -> None:
    with pytest.raises(RecordError):
        CompactLog.decode("~bnot bz2 at all")
    with pytest.raises(RecordError):
        CompactLog.decode('{"kept": 1}')
