"""The figures genq's benchmarks report, computed one way: percentiles, latency summaries
(time to first token, inter-token latency) and the per-stream token timing they come from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenTimes:
    """When one stream's tokens arrived (`time.perf_counter()` seconds)."""

    start: float
    """When the request was sent."""
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    """Inter-token latency samples: each token event's gap divided among its tokens (an event
    carries several tokens when the engine is ahead of the network)."""

    def arrived(self, now: float, n: int) -> None:
        """`n` tokens arrived in one event at `now`."""
        if n <= 0:
            return
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.extend([(now - self.last) / n] * n)
        self.last = now
        self.tokens += n

    def recount(self, tokens: int) -> None:
        """The stream carried `tokens` tokens in the events `arrived` counted as one each
        (an OpenAI chunk does not say how many it holds): each gap is divided by the
        average tokens per event."""
        if tokens <= 0 or self.tokens <= 0:
            return
        per_event = tokens / self.tokens
        self.gaps = [g / per_event for g in self.gaps]
        self.tokens = tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`th percentile (0–100) of `values` by nearest rank; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def ms(seconds: float | None, digits: int) -> float | None:
    return None if seconds is None else round(seconds * 1000, digits)


def latency(streams: Sequence[TokenTimes], digits: int) -> dict[str, float | None]:
    """Time to first token and inter-token latency, p50 and p99, in milliseconds rounded to
    `digits`, over every stream's samples."""
    ttfts = [t for s in streams if (t := s.ttft) is not None]
    gaps = [g for s in streams for g in s.gaps]
    return {
        "ttft_ms_p50": ms(percentile(ttfts, 50), digits),
        "ttft_ms_p99": ms(percentile(ttfts, 99), digits),
        "itl_ms_p50": ms(percentile(gaps, 50), digits),
        "itl_ms_p99": ms(percentile(gaps, 99), digits),
    }
