"""Prometheus histograms for the simulated replicas' vLLM metrics, with vLLM's bucket bounds."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# fmt: off
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# fmt: on
"""vLLM's `vllm:time_to_first_token_seconds` bucket bounds."""
TPOT_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
"""vLLM's `vllm:time_per_output_token_seconds` bucket bounds."""
ITERATION_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Bounds of `vllm:iteration_tokens_total` (tokens an engine step computed): its count is the
engine's steps."""


class Histogram:
    """A Prometheus histogram with fixed bounds."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def lines(self, name: str, labels: str) -> list[str]:
        out = []
        total = 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            total += count
            le = "+Inf" if bound == float("inf") else f"{bound}"
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
        out += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {total}"]
        return out
