"""An ended job's event log in compact form, and the events a resume gets from it.

A finished job's log holds an event per flush of its tokens (hundreds for a long job, each
repeating its envelope and JSON keys), kept for the whole retention period so that a client can
resume with any `Last-Event-ID`. Past a grace period (GENQ_EVENT_COMPACT_GRACE_S) a gateway
replaces it (`gateway.compaction`, shared/lua/compact.lua) by this: the events other than
tokens as they were written (queued, started, the final event...), and per token event only
its seq, attempt, how many characters of the text and how many tokens it carried. The text
and token ids are the record's result (packed) where they equal the log's, and kept here
otherwise; logprobs, which the result does not hold, are kept here when the job asked for them.

A resume after seq N then gets the same text, token ids and logprobs, and the same other
events with their seqs: each run of token events after N becomes one token event (or a few,
a page at a time) carrying the seq of the last event it stands for, so a client resuming from
that id again gets exactly what follows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from shared import events
from shared.events import EVENT_FIELD, TokenEvent
from shared.keys import seq_of
from shared.records import RecordError, pack, unpack
from shared.schemas import JobResult

Envelope = tuple[int, str, int, str]
"""(seq, type, attempt, the event's JSON)."""
LogEntries = Sequence[tuple[str, dict[str, str]]]
"""A job's event log as XRANGE reads it: (entry id, fields)."""
_ID_BYTES = 8
"""About what a token id adds to a token event's JSON: the page size's estimate."""


class CompactLog(BaseModel):
    """A job's event log without its token events' envelopes (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    kept: list[tuple[int, str]]
    """(seq, JSON) of every event but the tokens, as written, in seq order."""
    runs: list[tuple[int, int, int]]
    """(first seq, events, attempt) of each run of consecutive token events, in seq order."""
    chars: list[int]
    """Characters of text each token event carried, in order."""
    counts: list[int]
    """Tokens each token event carried (its `count`)."""
    text: str | None = None
    """The token events' text, joined; None: the record's result holds exactly it."""
    token_ids: list[int] | None = None
    """The token events' ids, joined; None: the record's result holds exactly them."""
    logprobs: list[dict[str, Any]] | None = None
    """The token events' logprobs entries, joined; None: none carried any."""
    logprob_counts: list[int] | None = None
    """Logprobs entries each token event carried (with `logprobs`)."""

    @classmethod
    def of(cls, entries: LogEntries, result: JobResult | None) -> CompactLog:
        """The compact form of a log; EventError if an entry is not an event."""
        kept: list[tuple[int, str]] = []
        runs: list[tuple[int, int, int]] = []
        chars: list[int] = []
        counts: list[int] = []
        texts: list[str] = []
        ids: list[int] = []
        logprobs: list[dict[str, Any]] = []
        lp_counts: list[int] = []
        for entry_id, fields in entries:
            seq, data = seq_of(entry_id), fields[EVENT_FIELD]
            ev = events.decode(data)
            if not isinstance(ev, TokenEvent):
                kept.append((seq, data))
                continue
            first, n, attempt = runs[-1] if runs else (0, 0, -1)
            if attempt == ev.attempt and first + n == seq:
                runs[-1] = (first, n + 1, attempt)
            else:
                runs.append((seq, 1, ev.attempt))
            chars.append(len(ev.text))
            counts.append(ev.count)
            texts.append(ev.text)
            ids += ev.token_ids
            lp_counts.append(len(ev.logprobs or ()))
            logprobs += ev.logprobs or ()
        text = "".join(texts)
        same = result is not None and result.text == text and result.token_ids == ids
        return cls(
            kept=kept,
            runs=runs,
            chars=chars,
            counts=counts,
            text=None if same else text,
            token_ids=None if same else ids,
            logprobs=logprobs or None,
            logprob_counts=lp_counts if logprobs else None,
        )

    def encode(self) -> str:
        return pack(self.model_dump_json(exclude_none=True))

    @classmethod
    def decode(cls, value: str) -> CompactLog:
        """RecordError for a value that is not one."""
        try:
            return cls.model_validate_json(unpack(value))
        except ValidationError as exc:
            raise RecordError(f"not a compact log: {exc.errors()[0].get('msg')}") from None

    @property
    def last_seq(self) -> int:
        ends = [s for s, _ in self.kept[-1:]] + [f + n - 1 for f, n, _ in self.runs[-1:]]
        return max(ends, default=0)

    def full_text(self, result: JobResult | None) -> str:
        """All the text its token events carried."""
        if self.text is not None:
            return self.text
        return result.text if result is not None else ""

    def replay(
        self, after: int, result: JobResult | None, *, max_bytes: int, max_events: int
    ) -> tuple[list[Envelope], bool]:
        """The events after seq `after`, at most `max_events` and about `max_bytes` of them
        (at least one); and whether more follow."""
        return _Replay(self, result, after, max_bytes, max_events).run()


class _Replay:
    """One page of a compact log's events after a seq (CompactLog.replay)."""

    def __init__(
        self, log: CompactLog, result: JobResult | None, after: int, max_bytes: int, max_events: int
    ) -> None:
        self.log = log
        self.text = log.full_text(result)
        ids = log.token_ids if log.token_ids is not None else None
        if ids is None:
            ids = result.token_ids if result is not None else []
        self.ids: list[int] = ids
        self.after = after
        self.max_bytes = max_bytes
        self.max_events = max_events
        self.out: list[Envelope] = []
        self.size = 0
        self.char = self.token = self.lp = 0
        """Offsets into the text, the ids and the logprobs of the next token event."""
        self.event = 0
        """Index of the next token event (into chars, counts, logprob_counts)."""

    def full(self) -> bool:
        return bool(self.out) and (len(self.out) >= self.max_events or self.size >= self.max_bytes)

    def run(self) -> tuple[list[Envelope], bool]:
        kept, runs = self.log.kept, self.log.runs
        k = r = 0
        while k < len(kept) or r < len(runs):
            if r == len(runs) or (k < len(kept) and kept[k][0] < runs[r][0]):
                seq, data = kept[k]
                k += 1
                if seq > self.after:
                    if self.full():
                        return self.out, True
                    _, etype, attempt = events.envelope(data)
                    self.out.append((seq, etype, attempt, data))
                    self.size += len(data)
                continue
            first, n, attempt = runs[r]
            r += 1
            if not self._tokens(first, n, attempt):
                return self.out, True
        return self.out, False

    def _tokens(self, first: int, n: int, attempt: int) -> bool:
        """The token events of one run after `after`, in chunks; False once the page is full
        with some of them left."""
        skip = min(max(self.after - first + 1, 0), n)
        for _ in range(skip):
            self._step(measure=False)
        seq = first + skip
        end = first + n
        while seq < end:
            if self.full():
                return False
            start = (self.char, self.token, self.lp)
            room = max(self.max_bytes - self.size, 1)
            grown = 0
            while seq < end and (grown == 0 or grown < room):
                grown += self._step()
                seq += 1
            self._emit(seq - 1, attempt, start)
            self.size += grown
        return True

    def _step(self, *, measure: bool = True) -> int:
        """Move past one token event; about the bytes it carried (if `measure`)."""
        log, e = self.log, self.event
        chars, count = log.chars[e], log.counts[e]
        lps = log.logprob_counts[e] if log.logprob_counts is not None else 0
        size = chars + _ID_BYTES * count
        if measure and lps and log.logprobs is not None:
            size += len(json.dumps(log.logprobs[self.lp : self.lp + lps]))
        self.char += chars
        self.token += count
        self.lp += lps
        self.event += 1
        return size

    def _emit(self, seq: int, attempt: int, start: tuple[int, int, int]) -> None:
        char, token, lp = start
        lps = self.log.logprobs[lp : self.lp] if self.log.logprobs is not None else None
        ev = TokenEvent(
            seq=seq,
            attempt=attempt,
            text=self.text[char : self.char],
            token_ids=self.ids[token : self.token],
            count=self.token - token,
            logprobs=lps or None,
        )
        self.out.append((seq, ev.type, attempt, events.encode(ev)))
