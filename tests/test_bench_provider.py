"""The simulated paid API's rate limit: a token bucket that answers how long to wait."""

from __future__ import annotations

from replicasim.provider import RateLimit, rate_limited_body


def test_the_bucket_lets_a_burst_through_then_names_the_wait_in_whole_seconds() -> None:
    limit = RateLimit(rate=2.0, burst=3)
    assert [limit.take(0.0) for _ in range(3)] == [None, None, None]
    assert limit.take(0.0) == 1  # half a second to the next token, rounded up
    assert limit.take(0.5) is None
    slow = RateLimit(rate=0.25, burst=1)
    assert slow.take(0.0) is None
    assert slow.take(0.0) == 4


def test_a_refusal_reads_like_openais() -> None:
    assert rate_limited_body(3)["error"]["code"] == "rate_limit_exceeded"
