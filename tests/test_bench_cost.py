"""The cost benchmark's arithmetic: dollars from tokens and prices, idle owned dollars from
the replicas' samples, the peak window, goodput, and targets judged on the median."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.cost.config import Phase, Prices, default_config
from bench.cost.report import summarize, targets
from bench.rig.loadgen import LoadSample, RequestResult, RunResult

CONFIG = replace(
    default_config(),
    replicas=4,
    phases=(
        Phase("ramp", 10.0, 0.5, measured=False),
        Phase("base", 10.0, 0.5),
        Phase("peak", 10.0, 1.5),
    ),
    prices=Prices(
        owned_per_replica_hour=3.6,
        paid_input_per_mtok=1.0,
        paid_cached_input_per_mtok=0.5,
        paid_output_per_mtok=2.0,
    ),
    objective=1.0,
)


def result(start: float, replica: str, ttft: float, session: str = "s1") -> RequestResult:
    return RequestResult(
        session=session,
        turn=0,
        start=start,
        status=200,
        replica=replica,
        ttft=ttft,
        latency=ttft + 1,
        prompt_tokens=1000,
        completion_tokens=100,
        cached_tokens=400,
    )


def test_dollars_tokens_idle_and_goodput_over_the_measured_window() -> None:
    run = RunResult(
        results=[
            result(5.0, "replica-0", 9.0),  # the ramp: not measured
            result(12.0, "replica-0", 0.2),
            result(22.0, "paid-0", 0.8, session="d7"),
            result(25.0, "replica-1", 3.0),
        ],
        samples=[LoadSample(at=15.0, in_flight={"replica-0": 4, "replica-1": 12})],
        wall_seconds=30.0,
        timed_out=False,
    )
    summary = summarize(run, CONFIG)
    assert summary["requests"] == 3 and summary["paid_requests"] == 1
    # 600 uncached at $1, 400 cached at $0.5, 100 out at $2 per million.
    assert summary["dollars"]["paid"] == pytest.approx((600 + 200 + 200) / 1e6)
    # 4 replicas at $3.6/h over the 20 measured seconds.
    assert summary["dollars"]["owned"] == pytest.approx(4 * 3.6 * 20 / 3600)
    assert summary["paid_token_share"] == pytest.approx(1 / 3)
    # Batches of 8: 4/8 and a full one (12 capped at 8): 75% busy.
    assert summary["owned_utilization"] == pytest.approx(0.75)
    assert summary["idle_owned_dollars"] == pytest.approx(summary["dollars"]["owned"] * 0.25)
    assert summary["goodput_per_s"] == pytest.approx(2 / 20)
    assert summary["peak_ttft_p99"] == pytest.approx(0.8 + (3.0 - 0.8) * 0.99)
    assert summary["budget_overshoot"] is None


def test_targets_are_judged_on_the_median_over_seeds() -> None:
    def seed(ratio: float) -> dict[str, dict[str, object]]:
        base = {
            "ttft_p99": 2.0,
            "peak_ttft_p99": 2.0,
            "goodput_per_s": 1.0,
            "dollars": {"paid": 1.0},
        }
        cost = {
            "ttft_p99": 2.0 * ratio,
            "peak_ttft_p99": 0.5,
            "goodput_per_s": 1.1,
            "dollars": {"paid": 0.5},
        }
        owned = {**base, "peak_ttft_p99": 2.0}
        return {"static_split": base, "cost_aware": cost, "owned_only": owned}

    verdicts = {what: met for what, met, _ in targets({1: seed(1.0), 2: seed(1.3), 3: seed(1.1)})}
    assert verdicts["cost-aware TTFT p99 at most 1.2x the static split's"] is True
    assert verdicts["cost-aware paid spend at most 0.6x the static split's"] is True
    assert verdicts["owned only's TTFT p99 at the peak at least 3x cost-aware's"] is True
    assert verdicts["cost-aware goodput at least the static split's"] is True


def test_the_excess_over_capacity_bounds_what_overflow_can_save() -> None:
    # Base 10 s at 0.5, peak 10 s at 1.5: 5 of 20 load-seconds are above capacity.
    assert CONFIG.excess_share() == pytest.approx(0.25)
