"""The cost benchmark's arithmetic: dollars from tokens and prices, idle owned dollars from
the replicas' samples, the peak window, goodput, targets judged on the median, and the
responses' usage priced as kvpilot prices it."""

from __future__ import annotations

import json
from dataclasses import replace
from decimal import Decimal

import pytest
from harness.golden import BENCH, check, updating

from bench.cost.config import (
    DEFAULT_GATE,
    ENGINE_WEIGHT_POLICY,
    GATE_POLICIES,
    PAID_POOL,
    POLICIES,
    Phase,
    Prices,
    default_config,
    engine_weight,
)
from bench.cost.floor import full_rate, measured_floor
from bench.cost.report import markdown, summarize, targets
from bench.cost.results import CostSummary, Dollars, FullRate, PhaseRow
from bench.cost.run import request_row
from bench.cost.spend import PoolSpend, between, differences, from_responses, from_view
from bench.rig.loadgen import LoadSample, RequestResult, RunResult
from bench.rig.stack import POOL
from policies.models import Overflow
from signals.spend import TokenPrice

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
    assert summary.requests == 3 and summary.paid_requests == 1
    # 600 uncached at $1, 400 cached at $0.5, 100 out at $2 per million.
    assert summary.dollars.paid == pytest.approx((600 + 200 + 200) / 1e6)
    # 4 replicas at $3.6/h over the 20 measured seconds.
    assert summary.dollars.owned == pytest.approx(4 * 3.6 * 20 / 3600)
    assert summary.paid_token_share == pytest.approx(1 / 3)
    # Batches of 8: 4/8 and a full one (12 capped at 8): 75% busy.
    assert summary.owned_utilization == pytest.approx(0.75)
    assert summary.idle_owned_dollars == pytest.approx(summary.dollars.owned * 0.25)
    assert summary.goodput_per_s == pytest.approx(2 / 20)
    assert summary.peak_ttft_p99 == pytest.approx(0.8 + (3.0 - 0.8) * 0.99)
    assert summary.budget_overshoot is None
    assert summary.wall_seconds == 30.0 and summary.timed_out is False
    # The run's JSON file holds it under its fields' names, and the report reads it back.
    data = json.loads(json.dumps(summary.to_json()))
    assert data["dollars_per_1k"]["paid"] == summary.dollars_per_1k.paid
    assert CostSummary.from_json(data) == summary


def test_targets_are_judged_on_the_median_over_seeds() -> None:
    quiet = summarize(RunResult(results=[], samples=[], wall_seconds=0.0, timed_out=False), CONFIG)

    def seed(ratio: float) -> dict[str, CostSummary]:
        base = replace(
            quiet, ttft_p99=2.0, peak_ttft_p99=2.0, goodput_per_s=1.0, dollars=Dollars(0.0, 1.0)
        )
        cost = replace(
            quiet,
            ttft_p99=2.0 * ratio,
            peak_ttft_p99=0.5,
            goodput_per_s=1.1,
            dollars=Dollars(0.0, 0.5),
        )
        owned = replace(base, peak_ttft_p99=2.0)
        return {"static_split": base, "cost_aware": cost, "owned_only": owned}

    verdicts = {what: met for what, met, _ in targets({1: seed(1.0), 2: seed(1.3), 3: seed(1.1)})}
    assert verdicts["the loop (signal: fill): TTFT p99 at most 1.2x the static split's"] is True
    assert verdicts["the loop (signal: fill): paid spend at most 0.6x the static split's"] is True
    assert (
        verdicts["the loop (signal: fill): owned only's TTFT p99 at the peak at least 3x its"]
        is True
    )
    assert verdicts["the loop (signal: fill): goodput at least the static split's"] is True


def test_overflow_by_arrivals_is_judged_against_the_loop_only_when_it_ran() -> None:
    quiet = summarize(RunResult(results=[], samples=[], wall_seconds=0.0, timed_out=False), CONFIG)
    base = replace(
        quiet, ttft_p99=2.0, peak_ttft_p99=2.0, goodput_per_s=1.0, dollars=Dollars(0.0, 1.0)
    )
    loop = replace(base, peak_ttft_p99=1.0, dollars=Dollars(0.0, 0.8))
    arrivals = replace(base, peak_ttft_p99=1.2, dollars=Dollars(0.0, 0.5))
    run = {"static_split": base, "cost_aware": loop, "owned_only": base}
    assert not any(what.startswith("by arrivals") for what, _, _ in targets({1: run}))
    verdicts = {
        what: met for what, met, _ in targets({1: {**run, "cost_aware_arrivals": arrivals}})
    }
    assert verdicts["by arrivals: paid spend below the loop's"] is True
    assert verdicts["by arrivals: TTFT p99 at the peak below the loop's"] is False
    assert verdicts["by arrivals: paid spend at most 0.6x the static split's"] is True


def test_a_gated_route_run_is_judged_on_the_issues_four_targets() -> None:
    quiet = summarize(RunResult(results=[], samples=[], wall_seconds=0.0, timed_out=False), CONFIG)
    base = replace(
        quiet, ttft_p99=2.0, peak_ttft_p99=6.0, goodput_per_s=1.0, dollars=Dollars(0.0, 1.0)
    )
    gated = replace(base, ttft_p99=1.0, peak_ttft_p99=1.5, dollars=Dollars(0.0, 0.7))
    label = GATE_POLICIES[DEFAULT_GATE][0]
    run = {"static_split": base, "cost_aware": base, "owned_only": base, DEFAULT_GATE: gated}
    verdicts = {what: met for what, met, _ in targets({1: run})}
    assert verdicts[f"{label}: TTFT p99 at most 1.2x the static split's"] is True
    assert verdicts[f"{label}: paid spend at most 0.6x the static split's"] is False
    assert verdicts[f"{label}: owned only's TTFT p99 at the peak at least 3x its"] is True
    assert verdicts[f"{label}: goodput at least the static split's"] is True
    # Every run has it; the other gated routes run when named.
    assert [p.key for p in POLICIES if p.key in GATE_POLICIES and p.default] == [DEFAULT_GATE]


def test_the_excess_over_capacity_bounds_what_overflow_can_save() -> None:
    # Base 10 s at 0.5, peak 10 s at 1.5: 5 of 20 load-seconds are above capacity.
    assert CONFIG.excess_share() == pytest.approx(0.25)


def test_capacity_is_measured_only_while_every_owned_replica_is_full() -> None:
    full: dict[str, float] = {"replica-0": 8, "replica-1": 9}
    samples = [
        LoadSample(at=10.0, in_flight={"replica-0": 8, "replica-1": 3}),  # one has room
        *(LoadSample(at=11.0 + i, in_flight=full) for i in range(6)),  # 11 to 17: all full
        LoadSample(at=17.0, in_flight={"replica-0": 2, "replica-1": 2}),
        LoadSample(at=18.0, in_flight={"replica-0": 2, "replica-1": 2}),
    ]
    ends = [10.5, 11.5, 12.0, 13.2, 16.9, 17.5]  # four end inside the full 6 s
    results = [result(end - 2.0, "replica-0", 1.0) for end in ends]  # latency = ttft + 1
    results.append(result(12.0, "paid-0", 1.0, session="d1"))  # paid: not the owned's
    run = RunResult(results=results, samples=samples, wall_seconds=20.0, timed_out=False)
    measured = full_rate(run, 8, (0.0, 30.0))
    assert measured is not None
    assert measured.rate == pytest.approx(4 / 6) and measured.seconds == 6.0
    # Full for less than 5 s: no measure. Nor outside the window.
    assert full_rate(run, 9, (0.0, 30.0)) is None
    assert full_rate(run, 8, (14.0, 30.0)) is None


def test_the_measured_floor_counts_the_offered_requests_above_the_measured_capacity() -> None:
    quiet = summarize(RunResult(results=[], samples=[], wall_seconds=0.0, timed_out=False), CONFIG)

    def phases(base: int, peak: int, paid: float = 0.0) -> dict[str, PhaseRow]:
        return {"base": PhaseRow(base, paid, 1.0), "peak": PhaseRow(peak, paid, 1.0)}

    # Owned only finished 2 requests/s while full; the other policies answered more of the
    # peak (its turns came back sooner): 40 offered there, 20 above 2/s over 10 s.
    owned = replace(quiet, phases=phases(10, 25), owned_full=FullRate(2.0, 8.0))
    static = replace(quiet, phases=phases(10, 40), dollars=Dollars(0.0, 10.0), paid_requests=10)
    aware = replace(quiet, phases=phases(10, 38), dollars=Dollars(0.0, 10.0), paid_requests=20)
    floor = measured_floor(
        {"owned_only": owned, "static_split": static, "cost_aware": aware}, CONFIG
    )
    assert floor is not None
    assert floor.excess == pytest.approx(20.0)
    assert floor.share == pytest.approx(20 / 50)
    # 50 requests over 20 load-seconds: 2.5/s at 100%, so 2/s is 80% of it.
    assert floor.nominal == pytest.approx(0.8)
    # At cost-aware's $0.50 a paid request (cheaper than the static split's $1): $10, 1.0x.
    assert floor.spend == pytest.approx(1.0)
    assert measured_floor({"static_split": static, "cost_aware": aware}, CONFIG) is None
    rendered = markdown(
        {1: {"owned_only": owned, "static_split": static, "cost_aware": aware}}, CONFIG
    )
    assert "| 1 | 2.00 (80%) | 20 requests (40.0%) | 1.00x | 1.00x |" in rendered
    # The load the replicas met, phase by phase, over the measured capacity: 40 in the
    # 10 s peak is 4/s, twice the 2/s; 10 in the base, half.
    assert floor.load["peak"] == pytest.approx(2.0)
    assert "| 1 | 0.50 | 2.00 |" in rendered


def test_the_report_rendered_from_a_runs_file_is_the_committed_markdown() -> None:
    """A real ``--short`` run of every policy (seed 1), read back from its JSON file: the
    table, the paid share by phase, the targets and the bound; and each policy's entry as
    the file has it, key for key, in order."""
    data = json.loads((BENCH / "cost-short.json").read_text())
    results = {
        int(seed): {key: CostSummary.from_json(entry) for key, entry in by_policy.items()}
        for seed, by_policy in data.items()
    }
    check(
        {"cost-short.md": markdown(results, default_config(short=True))}, BENCH, update=updating()
    )
    assert [list(s.to_json().items()) for s in results[1].values()] == [
        list(entry.items()) for entry in data["1"].values()
    ]


def test_a_larger_batch_grows_the_kv_cache_with_it_at_the_wall_clocks_pace() -> None:
    """At 32 sequences a replica holds four times the KV cache of 8 (the same per sequence,
    as the routing suite's replicas), the engines still run at the wall clock's pace, and the
    report says which batch size it ran."""
    small, large = default_config(), default_config(batch=32)
    assert small.routing.sim.max_batch == 8 and large.routing.sim.max_batch == 32
    assert large.routing.sim.kv_blocks == 4 * small.routing.sim.kv_blocks
    assert large.routing.sim.time_scale == small.routing.sim.time_scale == 1.0
    assert large.routing.capacity_batch == 32
    data = json.loads((BENCH / "cost-short.json").read_text())["1"]
    results = {1: {key: CostSummary.from_json(entry) for key, entry in data.items()}}
    assert "4 owned replicas batching 32 sequences" in markdown(results, large)
    assert "4 owned replicas batching 8 sequences" in markdown(results, small)


def test_the_engine_weight_policy_runs_with_the_simulated_engines_own_ratio() -> None:
    """``cost_aware_arrivals_w``: overflow by arrivals with ``prefillWeight`` at what the
    simulated engine's prefilled token costs against an output token at a full batch."""
    policy = next(p for p in POLICIES if p.key == ENGINE_WEIGHT_POLICY)
    for batch, weight in ((8, 0.0862), (32, 0.2439)):
        config = default_config(batch=batch)
        assert engine_weight(config.routing.sim) == weight
        route = config.policy(policy).route
        assert route["overflow"]["prefillWeight"] == weight
        assert Overflow.model_validate(route["overflow"]).prefill_weight == weight


def test_the_responses_account_prices_paid_usage_as_kvpilot_does() -> None:
    results = [
        result(12.0, "paid-0", 0.5),
        result(13.0, "replica-0", 0.5),
        replace(result(14.0, "paid-0", 0.5), prompt_tokens=0, completion_tokens=0),  # no usage
    ]
    account = from_responses(results, CONFIG.prices)
    assert account[POOL] == PoolSpend(1, 1000, 400, 100, Decimal(0))
    exact = TokenPrice(
        currency="USD", input=Decimal("1.0"), cached_input=Decimal("0.5"), output=Decimal("2.0")
    ).cost(1000, 400, 100)
    assert account[PAID_POOL] == PoolSpend(1, 1000, 400, 100, exact)
    assert CONFIG.prices.pool_price(paid=True) == {
        "currency": "USD",
        "input": "1.0",
        "cachedInput": "0.5",
        "output": "2.0",
    }
    assert CONFIG.prices.pool_price(paid=False) == {"currency": "USD", "replicaHour": "3.6"}


def test_kvpilots_account_of_a_replay_is_the_difference_of_two_readings() -> None:
    def view(requests: int, cost: str) -> dict[str, object]:
        row = {
            "pool": PAID_POOL,
            "currency": "USD",
            "requests": requests,
            "promptTokens": 10 * requests,
            "cachedTokens": 0,
            "completionTokens": requests,
            "cost": cost,
        }
        return {"rows": [row, {**row, "pool": POOL, "cost": "0"}]}

    before, after = from_view(view(2, "0.000004")), from_view(view(5, "0.000010"))
    counted = between(after, before)
    assert counted[PAID_POOL] == PoolSpend(3, 30, 0, 3, Decimal("0.000006"))
    assert differences(counted, counted) == []
    short = {**counted, PAID_POOL: PoolSpend(2, 30, 0, 3, Decimal("0.000006"))}
    assert differences(short, counted) == [
        f"pool {PAID_POOL}: requests 2 by kvpilot's spend, 3 from the responses"
    ]


def test_each_request_is_a_line_of_the_requests_file_with_its_side_and_its_wait() -> None:
    answered = RequestResult(
        session="s12-5",
        turn=2,
        start=57.31234,
        status=200,
        replica="replica-3",
        ttft=3.51234,
        engine_ttft=3.49,
        prompt_tokens=4100,
        cached_tokens=4000,
        completion_tokens=120,
    )
    row = json.loads(json.dumps(request_row("cost_aware_arrivals", answered)))
    assert row == {
        "policy": "cost_aware_arrivals",
        "session": "s12-5",
        "turn": 2,
        "start": 57.3123,
        "replica": "replica-3",
        "status": 200,
        "error": "",
        "ttft": 3.5123,
        "engine_ttft": 3.49,
        "prompt_tokens": 4100,
        "cached_tokens": 4000,
        "completion_tokens": 120,
    }
    failed = request_row("owned_only", RequestResult(session="d1-0", turn=0, start=1.0, error="x"))
    assert failed["ttft"] is None and failed["engine_ttft"] is None and failed["error"] == "x"
