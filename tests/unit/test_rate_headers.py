"""OpenAI's x-ratelimit-* headers as genq writes them: resets as Go durations (OpenAI's
`1s`, `6m0s`, `20ms`), one header triple per bucket the request's checks read."""

from __future__ import annotations

import pytest

from gateway.rate_headers import Seen, duration
from shared.transitions import Bucket


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (20, "20ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (24_600, "24.6s"),
        (59_999, "59.999s"),
        (60_000, "1m0s"),
        (90_500, "1m30.5s"),
        (360_000, "6m0s"),
        (3_600_000, "1h0m0s"),
        (3_723_004, "1h2m3.004s"),
    ],
)
def test_a_reset_is_written_as_openai_writes_durations(ms: int, text: str) -> None:
    assert duration(ms) == text


def test_each_bucket_read_gives_its_three_headers() -> None:
    assert Seen().headers() == []
    seen = Seen(tokens=Bucket(100_000, 98_500, 900))
    assert dict(seen.headers()) == {
        b"x-ratelimit-limit-tokens": b"100000",
        b"x-ratelimit-remaining-tokens": b"98500",
        b"x-ratelimit-reset-tokens": b"900ms",
    }
    seen.requests = Bucket(10, 0, 6000)
    assert dict(seen.headers())[b"x-ratelimit-reset-requests"] == b"6s"
    assert len(seen.headers()) == 6
