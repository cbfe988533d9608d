"""The scenario suite's own arithmetic: pooled percentiles and the weight timeline."""

from __future__ import annotations

from typing import Any

import pytest

from bench.routing.measure import goodput, weight_moves
from bench.routing.scenarios import SlowEvent
from bench.routing.targets import _share_evidence, capacity_ceiling, pooled_p99, targets


def _request(ttft: float | None, *, ok: bool = True) -> dict[str, Any]:
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
        (15.0, [35.0, 100.0]),
        (21.0, [35.0, 100.0]),
        (24.0, [50.0, 100.0]),
        (27.0, [100.0, 100.0]),
    ]
    moves = weight_moves(timeline, event)
    # The ring share from 5 s after the slowdown to its end (the sample at 15 s; 21 s is
    # after it): 35/135 against 1/2 before.
    assert moves == {
        "weight_changes": 3,
        "fell_after": 3.5,
        "back_after": 7.0,
        "ring_share_drop": (35 / 135) / 0.5,
    }
    assert weight_moves(timeline[:2], event)["fell_after"] is None


def test_the_share_of_new_sessions_is_also_given_with_the_seeds_pooled_and_as_a_ring_share() -> (
    None
):
    runs = [
        {
            "slow": {"new_sessions_before": [2, 14], "new_sessions_after_5s": [2, 26]},
            "weights": {"ring_share_drop": 0.38},
        },
        {
            "slow": {"new_sessions_before": [0, 12], "new_sessions_after_5s": [1, 18]},
            "weights": {"ring_share_drop": 0.53},
        },
        {
            "slow": {"new_sessions_before": [2, 16], "new_sessions_after_5s": [0, 27]},
            "weights": {"ring_share_drop": 0.38},
        },
    ]
    # 3 of 71 after against 4 of 42 before; a seed with none before has no ratio of its own.
    assert _share_evidence(runs) == (
        "; seeds pooled 0.44x (4 of 42 new sessions before, 3 of 71 after); ring share 0.38x"
    )
    assert _share_evidence([{"slow": {}, "weights": {}}]) == ""


def test_the_overload_target_says_what_any_router_could_reach_at_most() -> None:
    """Round robin spent 20% of its engines' time on prompt tokens at a hit rate of 80%; the
    oracle's 95% leaves a quarter of those tokens: 1 / (1 - 0.2 * 0.75) = 1.176x."""
    rr = {"prefill_share": 0.2, "engine_hit_rate": 0.8, "oracle_hit_rate": 0.95}
    assert capacity_ceiling(rr) == pytest.approx(1 / (1 - 0.2 * 0.75))
    assert capacity_ceiling({**rr, "prefill_share": None}) is None
    assert capacity_ceiling({**rr, "engine_hit_rate": 0.97}) == 1.0  # past the oracle

    def run(requests_per_s: float, **engine: float) -> dict[str, Any]:
        return {"requests_per_s": requests_per_s, "ttft_p99": 1.0, "hit_rate": 0.9, **engine}

    results = {
        "overload@8": {
            "round_robin": [run(10.0, **rr)],
            "affinity": [run(10.5)],
            "kvpilot": [run(10.4)],
        },
        # Round robin's engines spent 2% of their time on prompts: any router's ceiling is
        # 1.015x, and the route met it.
        "overload@32": {
            "round_robin": [run(10.0, **{**rr, "prefill_share": 0.02})],
            "kvpilot": [run(10.15)],
        },
    }
    found = {t[0]: t for t in targets(results) if "req/s" in t[1]}
    assert found["overload@8"][2] is False
    assert "1.04x" in found["overload@8"][3]
    assert "ceiling for any router 1.18x" in found["overload@8"][3]
    assert "spent 20% of their time on prompt tokens" in found["overload@8"][3]
    assert found["overload@32"][2] is True
    assert "ceiling for any router 1.02x" in found["overload@32"][3]


def test_goodput_at_another_objective_counts_over_the_measured_window() -> None:
    """A report read again at another objective divides by the run's measured window, as
    the run itself did, not by the span from the first request to the last answer."""
    per_request = [
        {**_request(0.2), "ttft": 9.0, "start": 30.0, "engine_latency": 60.0},
        {**_request(0.6), "ttft": 0.6, "start": 40.0, "engine_latency": 5.0},
        {**_request(None), "ttft": 0.1, "start": 50.0, "engine_latency": 5.0},
        _request(0.1, ok=False),
    ]
    # The engines' 0.2 s counts, not the client's 9 s; without an engine time, the client's.
    assert goodput(per_request, 0.5, window=55.0) == {
        "goodput_per_s": 2 / 55.0,
        "goodput_share": 2 / 4,
    }
    assert goodput(per_request, 1.0, window=55.0)["goodput_per_s"] == 3 / 55.0
    assert goodput([], 1.0, window=55.0)["goodput_share"] is None
