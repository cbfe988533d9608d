"""The cost benchmark's numbers per policy and its report: dollars per 1,000 requests (owned
and paid), the paid share of tokens, idle owned dollars, TTFT p50/p99 (and p99 at the
peak), goodput, budget overshoot; over several seeds, the median and the spread, and the
issue's targets as met / not met rows (pure, no I/O)."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence

from bench.cost.config import GATE_POLICIES, PAID_PREFIX, POLICIES, CostConfig
from bench.cost.floor import floor_lines, full_rate
from bench.cost.results import CostSummary, Dollars, PhaseRow, Results
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


Check = tuple[str, list[float | None], Callable[[float], bool]]
"""What a target says, its ratio seed by seed, and whether a median ratio meets it."""


def _issue_targets(results: Results, key: str, label: str) -> list[Check]:
    """The cost issue's four targets for the policy `key`, against the static split and owned
    only of the same seeds."""
    return [
        (
            f"{label}: TTFT p99 at most 1.2x the static split's",
            _ratios(results, (key, _ttft_p99), ("static_split", _ttft_p99)),
            lambda r: r <= 1.2,
        ),
        (
            f"{label}: paid spend at most 0.6x the static split's",
            _ratios(results, (key, _paid_dollars), ("static_split", _paid_dollars)),
            lambda r: r <= 0.6,
        ),
        (
            f"{label}: owned only's TTFT p99 at the peak at least 3x its",
            _ratios(results, ("owned_only", _peak_ttft_p99), (key, _peak_ttft_p99)),
            lambda r: r >= 3.0,
        ),
        (
            f"{label}: goodput at least the static split's",
            _ratios(results, (key, _goodput), ("static_split", _goodput)),
            lambda r: r >= 1.0,
        ),
    ]


def targets(results: Results) -> list[tuple[str, bool | None, str]]:
    """The issue's targets, each judged on the median over seeds: (what, met, measured)."""
    checks = _issue_targets(results, "cost_aware", "the loop (signal: fill)")
    present = {key for per_policy in results.values() for key in per_policy}
    for arrivals in sorted(key for key in present if key.startswith("cost_aware_arrivals")):
        # The same targets for overflow by arrivals (each objective run; `signal: arrivals`
        # is the default), and how it compares with the loop.
        by = "by arrivals" + arrivals.removeprefix("cost_aware_arrivals").replace("_", " ")
        checks += [
            *_issue_targets(results, arrivals, by),
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
    for gated in sorted(key for key in present if key in GATE_POLICIES):
        # The same targets for each gated route run (``overflow.maxInFlight``).
        checks += _issue_targets(results, gated, GATE_POLICIES[gated][0])
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


def markdown(results: Results, config: CostConfig) -> str:
    """The report over the seeds in `results` (seed -> policy -> summary)."""
    phases = ", ".join(f"{p.name} {p.duration:g}s at {p.load:.0%}" for p in config.phases)
    excess = config.excess_share()
    lines = [
        "# Cost-aware overflow",
        "",
        f"Seeds {', '.join(str(s) for s in results)}: median (min-max). {config.replicas} owned "
        f"replicas batching {config.routing.sim.max_batch} sequences at "
        f"${config.prices.owned_per_replica_hour:.2f}/h each; the paid API at "
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
        *floor_lines(results, config),
    ]
    return "\n".join(lines) + "\n"
