"""The prefill weight learned from the engines' counters (``signals.prefillfit``): the fit,
the intervals it takes from full replicas, a simulated engine's own ratio recovered through
its Prometheus counters, and overflow by arrivals weighing its work with what was learned."""

from __future__ import annotations

import asyncio
import random
from typing import Any, NamedTuple

import pytest
from harness.overflow import (
    KINDS,
    OUTPUT_COST,
    PREFILL_COST,
    TRUE_WEIGHT,
    compiled_arrivals,
    fit_of,
    full_intervals,
)
from pydantic import ValidationError

from policies.models import Overflow
from replicasim.simulator import Engine, SimConfig
from signals.overflowff import ArrivalsDecision, decide_arrivals, prefill_weight
from signals.overflowwork import PREFILL_WEIGHT, ReplicaLoad
from signals.prefillfit import (
    FIT_WINDOW,
    MAX_GAP,
    MAX_WEIGHT,
    MIN_FIT_WINDOWS,
    RESTART_AFTER,
    Opened,
    PrefillFit,
    fit_intervals,
    route_weight,
)
from signals.telemetry import extract, metric_map_for, parse_samples

NOW = 1_000_000.0
PORTS = (8001, 8002, 8003, 8004)


# --------------------------------------------------------------------------- the fit


def test_the_fit_finds_what_a_prefilled_token_costs_against_an_output_token() -> None:
    fit = fit_of(full_intervals(MIN_FIT_WINDOWS))
    costs = fit.costs()
    assert costs is not None
    assert costs[0] == pytest.approx(OUTPUT_COST, rel=1e-6)
    assert costs[1] == pytest.approx(PREFILL_COST, rel=1e-6)
    assert fit.weight() == pytest.approx(TRUE_WEIGHT, abs=1e-4)
    # With 3% noise on each interval's time, 30 of them still say it within a tenth.
    noisy = fit_of(full_intervals(30, seed=2, noise=0.03)).weight()
    assert noisy == pytest.approx(TRUE_WEIGHT, rel=0.1)


def test_until_the_fit_can_say_the_weight_is_the_constant() -> None:
    assert PrefillFit().weight() is None
    assert route_weight(None) == route_weight(PrefillFit()) == PREFILL_WEIGHT
    # Too few intervals.
    assert fit_of(full_intervals(MIN_FIT_WINDOWS - 1)).weight() is None
    # The tokens always in one proportion: their costs cannot be told apart.
    steady = fit_of([(12.0, 6000.0 * k, 24000.0 * k) for k in (1.0, 1.01, 0.99) * 4])
    assert steady.intervals >= MIN_FIT_WINDOWS and steady.weight() is None
    # A fit that is not physical (prefill costing nothing or less) is not used either.
    odd = fit_of([(10.0, 10000.0, p) for p in (0.0, 5000.0, 20000.0, 40000.0) * 3])
    assert odd.weight() is None and route_weight(odd) == PREFILL_WEIGHT


def test_a_learned_weight_is_bounded_and_older_intervals_fade() -> None:
    # Prefill dearer than decoding per token is read as noise and capped.
    dear = fit_of([(o * OUTPUT_COST + p * 3 * OUTPUT_COST, o, p) for _, o, p in full_intervals(10)])
    assert dear.weight() == MAX_WEIGHT
    # A new engine (twice the prefill cost) takes over as its intervals come in.
    fit = fit_of(full_intervals(40))
    for seconds, output, prefilled in full_intervals(200, seed=3):
        fit = fit.add(seconds + prefilled * PREFILL_COST, output, prefilled)
    assert fit.weight() == pytest.approx(2 * TRUE_WEIGHT, rel=0.1)
    assert fit.windows < 80  # about 1 / (1 - DECAY)


STEP_COST, SEQUENCE_COST = 0.02, 0.0004
"""The same engine's step: 20 ms whatever it holds, 0.4 ms a decoding sequence (33 ms at 32)."""


def _busy_intervals(count: int, seed: int = 1) -> list[tuple[float, float, float, float]]:
    """(seconds, output, prefilled, extra steps) of `count` intervals of that engine busy at
    a quarter to all of its batch of 32, its steps counted."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        decoding = rng.randint(8, 32)
        steps = rng.uniform(100, 200)
        output = steps * decoding
        prefilled = rng.uniform(1000, 12000)
        seconds = steps * STEP_COST + output * SEQUENCE_COST + prefilled * PREFILL_COST
        out.append((seconds, output, prefilled, steps - output / 32))
    return out


def test_with_steps_counted_busy_intervals_give_the_full_batchs_weight() -> None:
    intervals = _busy_intervals(MIN_FIT_WINDOWS + 2)
    fit = PrefillFit()
    for seconds, output, prefilled, extra in intervals:
        fit = fit.add(seconds, output, prefilled, extra)
    solution = fit.solve()
    assert solution is not None
    assert solution.a == pytest.approx(STEP_COST, rel=1e-6)
    full_batch = PREFILL_COST / (STEP_COST / 32 + SEQUENCE_COST)
    assert fit.weight() == pytest.approx(full_batch, abs=1e-4)
    # Without the steps the same intervals (not full) cannot say: the step's fixed part,
    # shared by fewer sequences than a full batch, is charged to the tokens (an output token
    # reads a quarter dearer) and what is left over makes the ratio too uncertain to use.
    blind = fit_of([(seconds, output, prefilled) for seconds, output, prefilled, _ in intervals])
    blind_solution = blind.solve()
    assert blind_solution is not None and blind_solution.a == 0.0
    assert blind_solution.c > 1.2 * (STEP_COST / 32 + SEQUENCE_COST)
    assert blind.weight() is None


def test_a_burst_counted_before_its_prefill_is_left_out_and_a_changed_engine_restarts() -> None:
    fit = PrefillFit()
    for interval in _busy_intervals(12):
        fit = fit.take(*interval)
    assert fit.intervals == 12 and fit.screened == 0
    # Thirty documents admitted at once, counted here and prefilled in the next intervals.
    seconds, output, prefilled, extra = _busy_intervals(1, seed=5)[0]
    burst = fit.take(seconds, output, prefilled + 30 * 3000, extra)
    assert (burst.intervals, burst.screened, burst.weight()) == (12, 1, fit.weight())
    # An engine whose prefill costs three times as much: left out until RESTART_AFTER
    # intervals in a row were (the burst among them), then the fit starts again from it
    # and learns it.
    changed = burst
    for seconds, output, prefilled, extra in _busy_intervals(20, seed=6):
        changed = changed.take(seconds + 2 * prefilled * PREFILL_COST, output, prefilled, extra)
    assert changed.screened == RESTART_AFTER
    dearer = 3 * PREFILL_COST / (STEP_COST / 32 + SEQUENCE_COST)
    assert changed.weight() == pytest.approx(dearer, rel=1e-3)


# --------------------------------------------------------------------------- the intervals


def _replica(at: float, output: float, prefilled: float, running: float = 1.0) -> ReplicaLoad:
    return ReplicaLoad(
        key="a", slots=32, running=running, work=None, at=at, total=output, prefilled=prefilled
    )


def test_an_interval_counts_once_a_replica_has_been_full_for_its_length() -> None:
    starts: dict[str, Opened] = {}
    fit = PrefillFit()
    for second in range(int(FIT_WINDOW) + 1):
        starts, fit = fit_intervals([_replica(second, 900.0 * second, 100.0 * second)], starts, fit)
    assert fit.intervals == 1
    # Seconds times tokens: FIT_WINDOW x 900 x FIT_WINDOW, and the same for the prefill.
    assert fit.to == pytest.approx(FIT_WINDOW * 900 * FIT_WINDOW)
    assert fit.tp == pytest.approx(FIT_WINDOW * 100 * FIT_WINDOW)
    # The next starts where that one ended; the same record read again changes nothing.
    assert starts["a"][:3] == (FIT_WINDOW, 900 * FIT_WINDOW, 100 * FIT_WINDOW)
    last = [_replica(FIT_WINDOW, 900 * FIT_WINDOW, 100 * FIT_WINDOW)]
    assert fit_intervals(last, starts, fit) == (starts, fit)


@pytest.mark.parametrize(
    ("record", "start"),
    [
        # Not full at 2 s: the interval starts at the next full record.
        (_replica(2.0, 2800.0, 1200.0, running=0.5), 4.0),
        # Its counters went back (the engine restarted): it starts at that record.
        (_replica(2.0, 100.0, 50.0), 2.0),
        # No counters: as not full.
        (ReplicaLoad(key="a", slots=32, running=1.0, work=None, at=2.0, total=None), 4.0),
    ],
    ids=["not-full", "restarted", "no-counters"],
)
def test_an_interval_starts_again_when_the_replica_is_not_seen_full_all_along(
    record: ReplicaLoad, start: float
) -> None:
    starts, fit = fit_intervals([_replica(0.0, 1000.0, 1000.0)], {}, PrefillFit())
    starts, fit = fit_intervals([record], starts, fit)
    for at in (4.0, 6.0):  # full again from 4 s: 6 s after the first record, 2 s after it
        starts, fit = fit_intervals([_replica(at, 5000 + 900 * at, 5000 + 100 * at)], starts, fit)
    assert fit.intervals == 0
    assert starts["a"][0] == start


def test_a_replica_that_counts_its_steps_is_read_while_busy_not_only_full() -> None:
    def busy(at: float, running: float, steps: float | None = 30.0) -> ReplicaLoad:
        return ReplicaLoad(
            key="a",
            slots=32,
            running=running,
            work=None,
            at=at,
            total=500.0 * at,
            prefilled=300.0 * at,
            steps=None if steps is None else steps * at,
        )

    starts, fit = fit_intervals([busy(0.0, 0.5)], {}, PrefillFit())
    starts, fit = fit_intervals([busy(FIT_WINDOW, 0.3)], starts, fit)
    assert fit.intervals == 1
    # 150 steps made 2,500 tokens: 150 - 2500 / 32 steps more than full decode batches.
    assert fit.tu == pytest.approx(FIT_WINDOW * (150 - 2500 / 32))
    # Below BUSY (an eighth: 4 of 32) it is not read, nor below BUSY_SEQUENCES in a small
    # batch; and an engine that stops counting its steps starts again.
    idle, _ = fit_intervals([busy(FIT_WINDOW + 1, 3 / 32)], starts, fit)
    assert "a" not in idle
    small = ReplicaLoad(
        key="b", slots=8, running=1 / 8, work=None, at=0.0, total=0.0, prefilled=0.0, steps=0.0
    )
    assert fit_intervals([small], {}, fit)[0] == {}
    again, same = fit_intervals([busy(2 * FIT_WINDOW, 1.0, steps=None)], starts, fit)
    assert again["a"].start == 2 * FIT_WINDOW and same == fit


def test_engines_side_by_side_behind_one_port_give_the_weight_of_one() -> None:
    """A data-parallel replica: two engines at a batch of 32 each, its record their sums
    (steps, tokens) and their batches together (64)."""

    def record(at: float, counts: tuple[float, float, float], engines: int) -> ReplicaLoad:
        output, prefilled, steps = counts
        return ReplicaLoad(
            key="dp",
            slots=64,
            running=0.5,
            work=None,
            at=at,
            total=output,
            prefilled=prefilled,
            steps=steps,
            engines=engines,
        )

    def fit_of(engines: int) -> PrefillFit:
        rng = random.Random(3)
        starts: dict[str, Opened] = {}
        fit, at, counts = PrefillFit(), 0.0, (0.0, 0.0, 0.0)
        starts, fit = fit_intervals([record(at, counts, engines)], starts, fit)
        for _ in range(3 * MIN_FIT_WINDOWS):
            seconds = rng.uniform(2, MAX_GAP)  # records at most MAX_GAP apart
            for _engine in range(2):  # each busy the whole interval, its own mix
                decoding, share = rng.randint(8, 32), rng.uniform(0.1, 0.6)
                steps = seconds * (1 - share) / (STEP_COST + decoding * SEQUENCE_COST)
                output, prefilled = steps * decoding, seconds * share / PREFILL_COST
                counts = (counts[0] + output, counts[1] + prefilled, counts[2] + steps)
            at += seconds
            starts, fit = fit_intervals([record(at, counts, engines)], starts, fit)
        return fit

    full_batch = PREFILL_COST / (STEP_COST / 32 + SEQUENCE_COST)
    assert fit_of(2).weight() == pytest.approx(full_batch, rel=1e-3)
    # Read as one engine at a batch of 64, the same counts give another weight.
    one = fit_of(1).weight()
    assert one is not None and one != pytest.approx(full_batch, rel=0.1), one


def test_records_too_far_apart_start_an_interval_again() -> None:
    starts, fit = fit_intervals([_replica(0.0, 0.0, 0.0)], {}, PrefillFit())
    starts, fit = fit_intervals([_replica(MAX_GAP + 1.0, 9900.0, 1100.0)], starts, fit)
    assert fit.intervals == 0 and starts["a"][0] == MAX_GAP + 1.0


# --------------------------------------------------------------------------- a real engine


class Driven(NamedTuple):
    fit: PrefillFit
    known_at: float | None
    """Busy seconds at which the fit first said a weight; None: it never did."""


async def _drive(batch: int, seconds: float, seed: int, *, moving: bool = False) -> Driven:
    """A simulated engine fed conversation turns (long cached system prompts, a short new
    question) and documents (thousands of new tokens), the documents' share changing every
    5-30 s; kept full, or (`moving`) its batch held at 30% to 110% of its slots, changing
    with the share, requests at least 0.1 s apart, and its steps read. Read through its Prometheus text every simulated
    second, the time being its own busy seconds (it is never idle while it has work), so a
    slow machine does not move it."""
    config = SimConfig(
        max_batch=batch,
        kv_blocks=384 * batch,
        prefill_per_token=PREFILL_COST,
        decode_base=0.02,
        decode_per_seq=0.0004,
        time_scale=0.005,
        stream_interval=1.0,
    )
    engine = Engine(config, "m")
    loop = asyncio.create_task(engine.run())
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50000) for _ in range(n)] for n in (1000, 2000, 3000, 4000)]
    metric_map = metric_map_for("vllm")
    starts: dict[str, Opened] = {}
    fit, previous, share, switch, scrape = PrefillFit(), None, 0.3, 0.0, 1.0
    occupancy, known_at, arrival = 1.0, None, 0.0
    try:
        while engine.busy_seconds < seconds:
            if engine.busy_seconds >= switch:
                share = rng.choice((0.05, 0.2, 0.4, 0.7))
                if moving:
                    occupancy = rng.choice((0.3, 0.5, 0.7, 0.9, 1.1))
                switch = engine.busy_seconds + rng.uniform(5, 30)
            held = int(occupancy * batch) if moving else batch + 2
            # Held at its share, requests arrive a tenth of a second apart at most (a
            # batch that moves up fills as a stream does, not all at once).
            while len(engine.running) + len(engine.waiting) < held and (
                not moving or engine.busy_seconds >= arrival
            ):
                arrival = engine.busy_seconds + 0.1
                if rng.random() < share:
                    prompt = [rng.randrange(1, 50000) for _ in range(rng.choice((2000, 3000)))]
                else:
                    question = int(rng.lognormvariate(5, 0.8)) + 20
                    prompt = rng.choice(systems) + [
                        rng.randrange(1, 50000) for _ in range(question)
                    ]
                engine.submit(prompt, min(600, int(rng.lognormvariate(5.3, 0.8)) + 5))
            if engine.busy_seconds >= scrape:
                samples = parse_samples("\n".join(engine.metrics_lines()))
                record, previous = extract(
                    samples, metric_map, at=engine.busy_seconds, previous=previous
                )
                replica = ReplicaLoad(
                    key="sim",
                    slots=batch,
                    running=(record.running or 0) / batch,
                    work=None,
                    at=record.at,
                    total=record.output_tokens_total,
                    prefilled=record.prefilled_tokens_total,
                    steps=record.steps_total if moving else None,
                )
                starts, fit = fit_intervals([replica], starts, fit)
                if known_at is None and fit.weight() is not None:
                    known_at = engine.busy_seconds
                scrape += 1.0
            await asyncio.sleep(0)
    finally:
        loop.cancel()
    return Driven(fit, known_at)


def _truth(batch: int) -> float:
    return PREFILL_COST / ((0.02 + 0.0004 * batch) / batch)  # 0.086 at 8, 0.244 at 32


@pytest.mark.parametrize("batch", [8, 32])
def test_the_fit_recovers_a_simulated_engines_own_ratio_from_its_counters(batch: int) -> None:
    fit = asyncio.run(_drive(batch, 600.0, seed=batch)).fit
    assert fit.intervals >= 20
    assert fit.weight() == pytest.approx(_truth(batch), rel=0.2)


@pytest.mark.parametrize("batch", [8, 32])
def test_with_its_steps_counted_a_busy_engine_gives_its_ratio_without_being_full(
    batch: int,
) -> None:
    driven = asyncio.run(_drive(batch, 200.0, seed=batch, moving=True))
    # Its steps come through its Prometheus text (vLLM's tokens-per-step histogram).
    assert driven.fit.intervals >= 20
    assert driven.known_at is not None and driven.known_at <= 150.0
    assert driven.fit.weight() == pytest.approx(_truth(batch), rel=0.15)


# --------------------------------------------------------------------------- in overflow


def _decide(before: ArrivalsDecision, **round_: Any) -> ArrivalsDecision:
    """A round of a route with ``KINDS`` and 10 requests a second, its batches half full
    unless `round_` says otherwise."""
    values: dict[str, Any] = {"slots": 128, "running": 0.5, "fill": 0.5, **round_}
    return decide_arrivals(
        before,
        demand=10.0,
        completions=None,
        service_time=10.0,
        kinds=KINDS,
        now=1000.0,
        **values,
    )


def test_overflow_weighs_the_demand_with_the_learned_weight() -> None:
    learned = fit_of(full_intervals(MIN_FIT_WINDOWS))
    weights = {}
    for name, fit in (("constant", PrefillFit()), ("learned", learned)):
        decision = _decide(ArrivalsDecision(fit=fit))
        weights[name] = prefill_weight(decision)
        expected = (100 + 300 + weights[name] * 3100) / 2
        assert decision.work == pytest.approx(expected, abs=0.01)
        # What it learned is carried to the next round.
        assert decision.fit == fit
    assert weights == {"constant": PREFILL_WEIGHT, "learned": pytest.approx(TRUE_WEIGHT, 1e-3)}


def test_when_the_weight_is_learned_the_held_capacity_keeps_its_requests_a_second() -> None:
    # One interval short of a fit that can say; this round's closes it.
    intervals = full_intervals(MIN_FIT_WINDOWS)
    almost = fit_of(intervals[:-1])
    seconds, output, prefilled = intervals[-1]
    starts = {"a": Opened(0.0, 0.0, 0.0, None, seconds - 1.0)}
    replica = ReplicaLoad(
        key="a", slots=32, running=1.0, work=None, at=seconds, total=output, prefilled=prefilled
    )
    held = 0.5  # work per slot a second, at the constant weight
    before = ArrivalsDecision(fit=almost, fit_starts=starts, work_per_slot=held)
    decision = _decide(before, slots=32, running=1.0, fill=1.0, replicas=[replica])
    assert before.prefill_weight == PREFILL_WEIGHT
    assert decision.prefill_weight == pytest.approx(TRUE_WEIGHT, rel=1e-3)
    old, new = KINDS.mean(PREFILL_WEIGHT), KINDS.mean(decision.prefill_weight)
    assert old is not None and new is not None
    assert decision.work_per_slot == pytest.approx(held * new / old, rel=1e-5)
    # In requests a second at this mix, the same before and after.
    assert decision.work_per_slot / new == pytest.approx(held / old, rel=1e-5)


def test_a_route_may_set_its_weight_and_the_fit_still_learns_beside_it() -> None:
    assert Overflow.model_validate({"pools": ["paid"]}).prefill_weight is None
    set_ = Overflow.model_validate({"pools": ["paid"], "prefillWeight": 0.25})
    assert set_.prefill_weight == 0.25
    for bad in (0, 0.001, 1.5, "high"):
        with pytest.raises(ValidationError, match="prefillWeight"):
            Overflow.model_validate({"pools": ["paid"], "prefillWeight": bad})
    with pytest.raises(ValidationError, match="prefillWeight is for signal: arrivals"):
        Overflow.model_validate({"pools": ["paid"], "signal": "fill", "prefillWeight": 0.2})

    # Compiled: the route's weight is used, and said to be set.
    def decided(**overflow: float) -> ArrivalsDecision:
        return compiled_arrivals(
            PORTS, now=NOW, live={"kind_work": {"main/chat": KINDS}}, **overflow
        )

    fixed = decided(prefillWeight=0.25)
    assert (fixed.prefill_weight, fixed.weight_source) == (0.25, "set")
    assert fixed.work == pytest.approx((100 + 300 + 0.25 * 3100) / 2, abs=0.01)
    cold = decided()
    assert (cold.prefill_weight, cold.weight_source) == (PREFILL_WEIGHT, "default")
    assert cold.work == pytest.approx((100 + 300 + PREFILL_WEIGHT * 3100) / 2, abs=0.01)
    # A fit that can say, beside a set weight: the set one wins, nothing is rescaled.
    learned = ArrivalsDecision(fit=fit_of(full_intervals(MIN_FIT_WINDOWS)), work_per_slot=0.5)
    assert learned.weight_source == "learned"
    kept = _decide(learned, slots=32, fixed_weight=0.05)
    assert (kept.prefill_weight, kept.weight_source, kept.work_per_slot) == (0.05, "set", 0.5)
    assert kept.fit == learned.fit
