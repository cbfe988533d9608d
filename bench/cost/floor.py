"""The cost benchmark's measured bound (pure, no I/O): the owned replicas' capacity as owned
only's replicas showed it (what they finished per second while every one had a full batch),
the offered requests above it phase by phase, and the paid spend that leaves no policy that
keeps the peak's latency to avoid, beside what the cost-aware policies paid."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from bench.cost.config import PAID_PREFIX, POLICIES, CostConfig
from bench.cost.results import CostSummary, FullRate, Results
from bench.rig.loadgen import RunResult

FULL_MIN_SECONDS = 5.0
"""The least time every owned replica must have been full for `full_rate` to count."""


def full_rate(run: RunResult, batch: int, window: tuple[float, float]) -> FullRate | None:
    """How fast the owned replicas finished requests while every one of them had a full
    batch (``batch`` or more in flight, so requests waited), within `window`: their capacity
    as measured, with the workload's own mix and cache hits. None when they were all full
    for less than ``FULL_MIN_SECONDS``.

    Each load sample stands for the time until the next one; a request counts where it
    ended (its start plus its latency)."""
    samples = sorted(run.samples, key=lambda sample: sample.at)
    spans = [
        (here.at, after.at)
        for here, after in itertools.pairwise(samples)
        if window[0] <= here.at < window[1]
        and here.in_flight
        and min(here.in_flight.values()) >= batch
    ]
    seconds = sum(end - begin for begin, end in spans)
    if seconds < FULL_MIN_SECONDS:
        return None
    ends = sorted(
        r.start + r.latency
        for r in run.results
        if r.ok and r.latency is not None and not r.replica.startswith(PAID_PREFIX)
    )
    done = sum(
        bisect.bisect_left(ends, end) - bisect.bisect_left(ends, begin) for begin, end in spans
    )
    return FullRate(rate=done / seconds, seconds=seconds)


@dataclass(frozen=True)
class MeasuredFloor:
    """What one seed's run says any policy that keeps the peak's latency must pay: the owned
    replicas' capacity as measured (owned only's ``owned_full``), the offered requests
    above it phase by phase, and those at the cheapest mean price a policy paid per request."""

    rate: float
    """Requests per second the owned replicas finished while all full."""
    nominal: float
    """That rate over the offered rate at a load of 100% (the capacity the load is set by)."""
    excess: float
    """Offered requests above the measured capacity, summed over the measured phases."""
    share: float
    """`excess` over the offered requests."""
    spend: float | None
    """`excess` at the cheapest mean price per paid request of this seed, over the static
    split's paid dollars; None without a static split."""
    load: Mapping[str, float] = field(default_factory=dict)
    """Per measured phase, the offered requests per second over `rate`: the load the owned
    replicas met, which is not the phase's nominal load (a conversation started in one
    phase sends its later turns in the next ones)."""


def measured_floor(
    per_policy: Mapping[str, CostSummary], config: CostConfig
) -> MeasuredFloor | None:
    """The paid spend a seed's run shows cannot be avoided without a queue at the peak, or
    None without owned only's measured capacity.

    The offered requests of a phase are the most any policy answered that started in it (a
    conversation's next turn waits for its answer, so a slow policy is offered fewer). A
    phase's excess is what it offered above the capacity over its duration; the queue a
    policy may build and drain later is not counted, so a policy that lets latency grow at
    the peak can pay less."""
    owned = per_policy.get("owned_only")
    if owned is None or owned.owned_full is None:
        return None
    rate = owned.owned_full.rate
    measured = [phase for phase in config.phases if phase.measured]
    offered = {
        phase.name: max(
            (s.phases[phase.name].requests for s in per_policy.values() if phase.name in s.phases),
            default=0,
        )
        for phase in measured
    }
    total = sum(offered.values())
    if not total:
        return None
    excess = sum(max(0.0, offered[phase.name] - rate * phase.duration) for phase in measured)
    at_full = total / sum(p.load * p.duration for p in measured)
    prices = [
        s.dollars.paid / s.paid_requests for s in per_policy.values() if s.paid_requests >= 10
    ]
    static = per_policy.get("static_split")
    spend = (
        excess * min(prices) / static.dollars.paid
        if prices and static is not None and static.dollars.paid
        else None
    )
    return MeasuredFloor(
        rate=rate,
        nominal=rate / at_full,
        excess=excess,
        share=excess / total,
        spend=spend,
        load={phase.name: offered[phase.name] / phase.duration / rate for phase in measured},
    )


def floor_lines(results: Results, config: CostConfig) -> list[str]:
    """The measured bound, seed by seed, beside what the cost-aware policies paid."""
    floors = {seed: measured_floor(per_policy, config) for seed, per_policy in results.items()}
    if not any(floors.values()):
        return []
    aware = [
        p.key
        for p in POLICIES
        if p.key.startswith("cost_aware") and any(p.key in r for r in results.values())
    ]
    lines = [
        "",
        "Measured bound: the owned replicas' capacity as owned only's replicas showed it, the "
        "requests they finished per second while every one had a full batch; the offered "
        "requests above it, phase by phase; and those at the cheapest mean price per paid "
        "request of the seed, against the static split's paid spend. A policy that keeps the "
        "peak's latency pays at least that (a queue held at the peak and drained after it "
        "pays less).",
        "",
        "| seed | capacity (req/s, share of nominal) | offered above it | spend floor vs static "
        "split | " + " | ".join(f"{key} paid" for key in aware) + " |",
        "|---|---|---|---|" + "---|" * len(aware),
    ]
    for seed, floor in floors.items():
        if floor is None:
            continue
        static = results[seed].get("static_split")
        paid = [
            f"{s.dollars.paid / static.dollars.paid:.2f}x"
            if (s := results[seed].get(key)) is not None and static and static.dollars.paid
            else "n/a"
            for key in aware
        ]
        spend = "n/a" if floor.spend is None else f"{floor.spend:.2f}x"
        lines.append(
            f"| {seed} | {floor.rate:.2f} ({floor.nominal:.0%}) | {floor.excess:.0f} requests "
            f"({floor.share:.1%}) | {spend} | " + " | ".join(paid) + " |"
        )
    names = [p.name for p in config.phases if p.measured]
    lines += [
        "",
        "The load the owned replicas met: offered requests per second over that capacity, "
        "phase by phase (a conversation started in one phase sends its later turns in the "
        "next ones, so the requests per second peak after the sessions' rate does).",
        "",
        "| seed | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for seed, floor in floors.items():
        if floor is not None:
            loads = (f"{floor.load[name]:.2f}" if name in floor.load else "n/a" for name in names)
            lines.append(f"| {seed} | " + " | ".join(loads) + " |")
    return lines


__all__ = ["FULL_MIN_SECONDS", "MeasuredFloor", "floor_lines", "full_rate", "measured_floor"]
