"""The cost benchmark's numbers per policy and its report: dollars per 1,000 requests (owned
and paid), the paid share of tokens, idle owned dollars, TTFT p50/p99 (and p99 at the
peak), goodput, budget overshoot; over several seeds, the median and the spread, and the
issue's targets as met / not met rows (pure, no I/O)."""

from __future__ import annotations

import bisect
import functools
import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from bench.cost.config import PAID_PREFIX, POLICIES, CostConfig
from bench.cost.results import CostSummary, Dollars, FullRate, PhaseRow
from bench.rig.loadgen import RequestResult, RunResult
from bench.rig.summary import percentile


def summarize(run: RunResult, config: CostConfig) -> CostSummary:
    """One policy's numbers over the measured window (requests sent after the ramp)."""
    start, end = config.ramp, config.duration
    window = max(1e-9, end - start)
    measured = [r for r in run.results if start <= r.start < end]
    ok = [r for r in measured if r.ok]
    paid = [r for r in ok if r.replica.startswith(PAID_PREFIX)]
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in ok)
    paid_tokens = sum(r.prompt_tokens + r.completion_tokens for r in paid)
    prices = config.prices
    paid_dollars = sum(
        prices.paid(r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in paid
    )
    owned_dollars = config.replicas * prices.owned_per_replica_hour * window / 3600
    batch = config.routing.sim.max_batch
    busy = [
        min(value, batch) / batch
        for sample in run.samples
        if start <= sample.at < end
        for value in sample.in_flight.values()
    ]
    utilization = statistics.fmean(busy) if busy else None
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    peak_start, peak_end = config.window("peak")
    peak = [r.ttft for r in ok if r.ttft is not None and peak_start <= r.start < peak_end]
    good = [r for r in ok if r.ttft is not None and r.ttft <= config.objective]
    conversations = [r for r in ok if not r.session.startswith("d")]
    full = full_rate(run, batch, (start, end))
    return CostSummary(
        requests=len(measured),
        ok=len(ok),
        errors=len(measured) - len(ok),
        paid_requests=len(paid),
        paid_conversation_turns=sum(1 for r in conversations if r.replica.startswith(PAID_PREFIX)),
        conversation_turns=len(conversations),
        paid_token_share=paid_tokens / tokens if tokens else 0.0,
        dollars=Dollars(owned=owned_dollars, paid=paid_dollars),
        dollars_per_1k=Dollars(
            owned=owned_dollars / len(ok) * 1000 if ok else 0.0,
            paid=paid_dollars / len(ok) * 1000 if ok else 0.0,
        ),
        owned_utilization=utilization,
        idle_owned_dollars=owned_dollars * (1 - utilization) if utilization is not None else None,
        ttft_p50=percentile(ttfts, 50) or 0.0,
        ttft_p99=percentile(ttfts, 99) or 0.0,
        peak_ttft_p99=percentile(peak, 99) or 0.0,
        goodput_per_s=len(good) / window,
        budget_overshoot=None,
        phases=_phases(ok, config),
        owned_full=full,
        wall_seconds=run.wall_seconds,
        timed_out=run.timed_out,
    )


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


def _phases(ok: Sequence[RequestResult], config: CostConfig) -> dict[str, PhaseRow]:
    """Per phase: requests answered, the share the paid API answered, and TTFT p99."""
    out: dict[str, PhaseRow] = {}
    start = 0.0
    for phase in config.phases:
        inside = [r for r in ok if start <= r.start < start + phase.duration]
        start += phase.duration
        if not phase.measured:
            continue
        paid = sum(1 for r in inside if r.replica.startswith(PAID_PREFIX))
        ttfts = [r.ttft for r in inside if r.ttft is not None]
        out[phase.name] = PhaseRow(
            requests=len(inside),
            paid_share=paid / len(inside) if inside else 0.0,
            ttft_p99=percentile(ttfts, 99),
        )
    return out


def _stats(values: Sequence[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max), None without values."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None, None
    return statistics.median(present), min(present), max(present)


def _fmt(values: Sequence[float | None], fmt: str) -> str:
    median, low, high = _stats(values)
    if median is None or low is None or high is None:
        return "n/a"
    if len(values) == 1:
        return fmt.format(median)
    return f"{fmt.format(median)} ({fmt.format(low)}-{fmt.format(high)})"


Results = Mapping[int, Mapping[str, CostSummary]]
"""Seed -> policy -> its numbers."""

Value = Callable[[CostSummary], float | None]
"""One number of a policy's run."""


def _column(results: Results, policy: str, value: Value) -> list[float | None]:
    """`value` of `policy` in every seed (None where the seed did not run it)."""
    return [
        None if (summary := per_policy.get(policy)) is None else value(summary)
        for per_policy in results.values()
    ]


ROWS: tuple[tuple[str, Value, str], ...] = (
    ("owned $ / 1,000 requests", lambda s: s.dollars_per_1k.owned, "{:.4f}"),
    ("paid $ / 1,000 requests", lambda s: s.dollars_per_1k.paid, "{:.4f}"),
    ("paid $ in the run", lambda s: s.dollars.paid, "{:.5f}"),
    (
        "paid $ in the replay, kvpilot's spend",
        lambda s: None if s.spend is None else s.spend.paid_dollars.kvpilot,
        "{:.6f}",
    ),
    (
        "paid $ in the replay, responses' usage",
        lambda s: None if s.spend is None else s.spend.paid_dollars.responses,
        "{:.6f}",
    ),
    ("paid share of tokens", lambda s: s.paid_token_share, "{:.1%}"),
    ("idle owned $", lambda s: s.idle_owned_dollars, "{:.4f}"),
    ("owned utilization", lambda s: s.owned_utilization, "{:.0%}"),
    ("TTFT p50 (s)", lambda s: s.ttft_p50, "{:.3f}"),
    ("TTFT p99 (s)", lambda s: s.ttft_p99, "{:.3f}"),
    ("TTFT p99 at the peak (s)", lambda s: s.peak_ttft_p99, "{:.3f}"),
    ("goodput (req/s within objective)", lambda s: s.goodput_per_s, "{:.2f}"),
    ("requests paid", lambda s: s.paid_requests, "{:.0f}"),
    ("conversation turns paid", lambda s: s.paid_conversation_turns, "{:.0f}"),
    ("errors", lambda s: s.errors, "{:.0f}"),
)


def table(results: Results) -> list[str]:
    """The per-policy table: the median over seeds and (min-max)."""
    policies = [p for p in POLICIES if any(p.key in r for r in results.values())]
    lines = [
        "| | " + " | ".join(p.title for p in policies) + " |",
        "|---|" + "---|" * len(policies),
    ]
    for title, value, fmt in ROWS:
        cells = [_fmt(_column(results, p.key, value), fmt) for p in policies]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines.append("| budget overshoot | " + " | ".join("n/a (no budget)" for _ in policies) + " |")
    lines += ["", *spend_agreement(results)]
    lines += ["", "Paid share of requests by phase (median over seeds):", ""]
    first = next(iter(results.values()))
    names = list(next(iter(first.values())).phases) if first else []
    lines.append("| phase | " + " | ".join(p.title for p in policies) + " |")
    lines.append("|---|" + "---|" * len(policies))
    for name in names:
        share: Value = functools.partial(_paid_share, phase=name)
        cells = [_fmt(_column(results, p.key, share), "{:.0%}") for p in policies]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _paid_share(summary: CostSummary, phase: str) -> float | None:
    row = summary.phases.get(phase)
    return None if row is None else row.paid_share


def spend_agreement(results: Results) -> list[str]:
    """Whether kvpilot's own spend over each replay equals the responses' usage at the same
    prices (``bench.cost.spend``), to the token and to the last digit of money."""
    differing = [
        f"- seed {seed}, {policy}: " + "; ".join(summary.spend.differences)
        for seed, per_policy in results.items()
        for policy, summary in per_policy.items()
        if summary.spend is not None and summary.spend.differences
    ]
    checked = sum(
        1
        for per_policy in results.values()
        for summary in per_policy.values()
        if summary.spend is not None
    )
    if not checked:
        return ["kvpilot's spend was not read in this run."]
    if not differing:
        return [
            "kvpilot's spend (`GET /v1/spend`, per pool, read before and after each replay) "
            "equals the responses' usage at the pools' prices in every replay: requests, "
            "prompt, cached and completion tokens, and dollars to the last digit."
        ]
    return ["kvpilot's spend DIFFERS from the responses' usage:", "", *differing]


def _ratios(
    results: Results, top: tuple[str, Value], bottom: tuple[str, Value]
) -> list[float | None]:
    """Seed by seed, `top`'s policy's value over `bottom`'s."""
    out = []
    for per_policy in results.values():
        a = _column({0: per_policy}, *top)[0]
        b = _column({0: per_policy}, *bottom)[0]
        out.append(a / b if a is not None and b else None)
    return out


def targets(results: Results) -> list[tuple[str, bool | None, str]]:
    """The issue's targets, each judged on the median over seeds: (what, met, measured)."""
    checks: list[tuple[str, list[float | None], Callable[[float], bool]]] = [
        (
            "cost-aware TTFT p99 at most 1.2x the static split's",
            _ratios(results, ("cost_aware", _ttft_p99), ("static_split", _ttft_p99)),
            lambda r: r <= 1.2,
        ),
        (
            "cost-aware paid spend at most 0.6x the static split's",
            _ratios(results, ("cost_aware", _paid_dollars), ("static_split", _paid_dollars)),
            lambda r: r <= 0.6,
        ),
        (
            "owned only's TTFT p99 at the peak at least 3x cost-aware's",
            _ratios(results, ("owned_only", _peak_ttft_p99), ("cost_aware", _peak_ttft_p99)),
            lambda r: r >= 3.0,
        ),
        (
            "cost-aware goodput at least the static split's",
            _ratios(results, ("cost_aware", _goodput), ("static_split", _goodput)),
            lambda r: r >= 1.0,
        ),
    ]
    present = {key for per_policy in results.values() for key in per_policy}
    for arrivals in sorted(key for key in present if key.startswith("cost_aware_arrivals")):
        # The same targets for overflow by arrivals (each objective run), and how it compares
        # with the loop (its default only if it beats the loop on both spend and the peak).
        by = "by arrivals" + arrivals.removeprefix("cost_aware_arrivals").replace("_", " ")
        checks += [
            (
                f"{by}: TTFT p99 at most 1.2x the static split's",
                _ratios(results, (arrivals, _ttft_p99), ("static_split", _ttft_p99)),
                lambda r: r <= 1.2,
            ),
            (
                f"{by}: paid spend at most 0.6x the static split's",
                _ratios(results, (arrivals, _paid_dollars), ("static_split", _paid_dollars)),
                lambda r: r <= 0.6,
            ),
            (
                f"{by}: owned only's TTFT p99 at the peak at least 3x its",
                _ratios(results, ("owned_only", _peak_ttft_p99), (arrivals, _peak_ttft_p99)),
                lambda r: r >= 3.0,
            ),
            (
                f"{by}: goodput at least the static split's",
                _ratios(results, (arrivals, _goodput), ("static_split", _goodput)),
                lambda r: r >= 1.0,
            ),
            (
                f"{by}: paid spend below the loop's",
                _ratios(results, (arrivals, _paid_dollars), ("cost_aware", _paid_dollars)),
                lambda r: r < 1.0,
            ),
            (
                f"{by}: TTFT p99 at the peak below the loop's",
                _ratios(results, (arrivals, _peak_ttft_p99), ("cost_aware", _peak_ttft_p99)),
                lambda r: r < 1.0,
            ),
        ]
    out: list[tuple[str, bool | None, str]] = []
    for what, ratios, holds in checks:
        median, low, high = _stats(ratios)
        if median is None:
            out.append((what, None, "not run"))
            continue
        out.append((what, holds(median), f"{median:.2f}x (seeds {low:.2f}-{high:.2f})"))
    return out


def _ttft_p99(summary: CostSummary) -> float:
    return summary.ttft_p99


def _peak_ttft_p99(summary: CostSummary) -> float:
    return summary.peak_ttft_p99


def _paid_dollars(summary: CostSummary) -> float:
    return summary.dollars.paid


def _goodput(summary: CostSummary) -> float:
    return summary.goodput_per_s


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


def _floor_lines(results: Results, config: CostConfig) -> list[str]:
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


def markdown(results: Results, config: CostConfig) -> str:
    """The report over the seeds in `results` (seed -> policy -> summary)."""
    phases = ", ".join(f"{p.name} {p.duration:g}s at {p.load:.0%}" for p in config.phases)
    excess = config.excess_share()
    lines = [
        "# Cost-aware overflow",
        "",
        f"Seeds {', '.join(str(s) for s in results)}: median (min-max). {config.replicas} owned "
        f"replicas at ${config.prices.owned_per_replica_hour:.2f}/h each; the paid API at "
        f"${config.prices.paid_input_per_mtok:.2f} / ${config.prices.paid_cached_input_per_mtok:.2f}"
        f" / ${config.prices.paid_output_per_mtok:.2f} per million input / cached input / "
        f"output tokens, {config.paid_sim.first_token_delay:g} s added before its engine, "
        f"{config.paid_sim.rate_limit:g} requests/s. Load (share of the owned capacity): "
        f"{phases}. TTFT objective {config.objective:g} s.",
        "",
        *table(results),
        "",
        "## Targets",
        "",
        "| target | met | measured |",
        "|---|---|---|",
    ]
    for what, met, measured in targets(results):
        verdict = "n/a" if met is None else ("met" if met else "NOT met")
        lines.append(f"| {what} | {verdict} | {measured} |")
    lines += [
        "",
        f"Bound: {excess:.1%} of the measured load is above the owned capacity "
        "(estimated at perfect affinity, an upper bound on capacity). A policy that keeps its latency at the peak sends at least that "
        "to the paid API; the static split sends 20%, so its paid spend can be cut to no "
        f"less than about {excess / 0.2:.2f}x of it if its paid requests cost what the "
        "static split's do (the measured bound, where the run has one, prices them).",
        *_floor_lines(results, config),
    ]
    return "\n".join(lines) + "\n"
