"""What makes a simulated replica a paid API rather than an owned GPU: the latency a hosted
endpoint adds before a request reaches its engine (the network, the provider's own queue),
and its rate limit, answered as OpenAI answers it: 429 with a ``Retry-After``.

A replica gets them from its ``SimConfig`` (``first_token_delay``, ``rate_limit``,
``rate_burst``); everything else (continuous batching, prefix caching, usage) is the engine's.
A paid API's capacity is large: give it a large ``max_batch``.
"""

from __future__ import annotations

import math
from typing import Any


class RateLimit:
    """A token bucket of ``rate`` requests per simulated second, ``burst`` deep."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = max(1.0, burst)
        self.tokens = self.burst
        self.at: float | None = None

    def take(self, now: float) -> int | None:
        """Admit one request at simulated time `now` (None), or refuse it: the whole seconds
        until the bucket holds a token again, for ``Retry-After``."""
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - self.tokens) / self.rate))


def rate_limited_body(retry_after: int) -> dict[str, Any]:
    """OpenAI's answer to a request over the rate limit."""
    return {
        "error": {
            "message": f"Rate limit reached for requests. Please try again in {retry_after}s.",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
