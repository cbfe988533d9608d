"""The scenario suite's own arithmetic: pooled percentiles and the weight timeline."""

from __future__ import annotations

from typing import Any

from bench.scenarios import SlowEvent
from bench.suite_measure import weight_moves
from bench.suite_report import pooled_p99


def _request(ttft: float, *, ok: bool = True) -> dict[str, Any]:
    return {"status": 200 if ok else 503, "error": "" if ok else "HTTP 503", "engine_ttft": ttft}


def test_pooled_p99_reads_every_seed_and_skips_failures() -> None:
    seed_a = [_request(t / 100) for t in range(1, 101)]
    seed_b = [_request(t / 100 + 1.0) for t in range(1, 101)] + [_request(99.0, ok=False)]
    # 200 successful requests: the 198th smallest.
    assert pooled_p99([{"per_request": seed_a}, {"per_request": seed_b}]) == 1.98
    assert pooled_p99([{"per_request": []}]) is None


def test_weight_moves_counts_changes_and_times_the_slowed_replica() -> None:
    event = SlowEvent(replica=0, factor=3.0, start=8.0, end=20.0)
    timeline = [
        (5.0, [100.0, 100.0]),
        (9.0, [100.0, 100.0]),
        (11.5, [35.0, 100.0]),
        (21.0, [35.0, 100.0]),
        (24.0, [50.0, 100.0]),
        (27.0, [100.0, 100.0]),
    ]
    moves = weight_moves(timeline, event)
    assert moves == {"weight_changes": 3, "fell_after": 3.5, "back_after": 7.0}
    assert weight_moves(timeline[:2], event)["fell_after"] is None
