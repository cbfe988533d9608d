"""The scenario suite's numbers compared: paired per-seed ratios and their spread, the
issue's targets on the recommended policy with the bounds that limit them (the completed
requests' ceiling, the TTFT floor), and the recommended route's ratios per batch size."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

from bench.rig.report import table
from bench.routing.measure import engine_ttft
from bench.routing.results import Measured, Runs, SuiteResults
from bench.routing.scenarios import ORACLE, RECOMMENDED, median_spread, split_key

T = TypeVar("T")

Value = Callable[[Measured], float | None]
"""One number of a run, or None where the run has none."""


def cell(runs: Sequence[T], value: Callable[[T], float | None], pattern: str) -> str:
    """One table cell: the median over `runs` (seeds) and, when they differ, the spread."""
    stats = median_spread([value(m) for m in runs])
    if stats is None:
        return "n/a"
    mid, low, high = stats
    if len(runs) == 1 or low == high:
        return pattern.format(mid)
    return f"{pattern.format(mid)} ({pattern.format(low)}-{pattern.format(high)})"


def paired(mine: Runs, base: Runs, value: Value) -> tuple[float, float, float] | None:
    """Median and spread of mine/base, seed by seed (both replayed the same workload)."""
    ratios = []
    for a, b in zip(mine, base, strict=False):
        x, y = value(a), value(b)
        if x is not None and y:
            ratios.append(x / y)
    return median_spread(ratios)


def ratio_text(stats: tuple[float, float, float] | None) -> str:
    if stats is None:
        return "n/a"
    mid, low, high = stats
    return f"{mid:.2f}x ({low:.2f}-{high:.2f})"


def pooled_p99(runs: Runs) -> float | None:
    """TTFT p99 (as the engines timed it) over the requests of every seed together: one
    seed's p99 is its slowest two or three requests, the pooled one rests on several times
    as many."""
    ttfts = sorted(
        t for m in runs for r in m.per_request if r.ok and (t := engine_ttft(r)) is not None
    )
    if not ttfts:
        return None
    return ttfts[min(len(ttfts) - 1, max(0, round(0.99 * len(ttfts)) - 1))]


def pooled_ratio(mine: Runs, base: Runs) -> str:
    a, b = pooled_p99(mine), pooled_p99(base)
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


Target = tuple[str, str, bool | None, str]
"""(scenario, claim, met, measured)."""


def targets(results: SuiteResults) -> list[Target]:
    """The issue's targets, on the recommended policy, from paired per-seed ratios."""
    out: list[Target] = []

    def check(
        scenario: str,
        claim: str,
        base: str,
        value: Value,
        ok: Callable[[float], bool],
        evidence: Callable[[Runs], str] | None = None,
    ) -> None:
        runs = results.get(scenario, {})
        if RECOMMENDED not in runs or base not in runs:
            return
        stats = paired(runs[RECOMMENDED], runs[base], value)
        if evidence is _ttft_floor:
            # The floor is the recommended route's own, against its baseline's p99.
            text = ratio_text(stats)
            text += evidence(runs[RECOMMENDED]) + _floor_ratio(runs[RECOMMENDED], runs[base])
            out.append((scenario, claim, None if stats is None else ok(stats[0]), text))
            return
        text = ratio_text(stats)
        if "TTFT p99" in claim and "slow period" not in claim and "after" not in claim:
            text += f"; all seeds pooled {pooled_ratio(runs[RECOMMENDED], runs[base])}"
        if evidence is not None:
            text += evidence(runs[base])
        met = None if stats is None else ok(stats[0])
        if evidence is _capacity_ceiling and stats is not None and not met:
            # "Or the computed ceiling, if lower": met at the ceiling any router has.
            ceilings = [c for m in runs[base] if (c := capacity_ceiling(m)) is not None]
            met = bool(ceilings) and stats[0] >= min(statistics.median(ceilings), 1.05) - 0.005
        out.append((scenario, claim, met, text))

    def absolute(
        scenario: str,
        claim: str,
        value: Value,
        ok: Callable[[float], bool],
        pattern: str,
        evidence: Callable[[Runs], str] | None = None,
    ) -> None:
        runs = results.get(scenario, {}).get(RECOMMENDED)
        if runs is None:
            return
        stats = median_spread([value(m) for m in runs])
        met = None if stats is None else ok(stats[0])
        text = "n/a" if stats is None else cell(runs, value, pattern)
        if evidence is not None:
            text += evidence(runs)
        out.append((scenario, claim, met, text))

    def ttft_p99(m: Measured) -> float | None:
        return m.ttft_p99

    def moved(m: Measured) -> float:
        return float(max(1, m.moved))  # zero moves on both sides is a ratio of 1

    # (scenario, claim, baseline policy, value, the ratio's test[, evidence from the baseline]),
    # issue #31's, checked at every batch size the run has.
    paired_targets: tuple[
        tuple[str, str, str, Value, Callable[[float], bool]]
        | tuple[
            str,
            str,
            str,
            Value,
            Callable[[float], bool],
            Callable[[Runs], str],
        ],
        ...,
    ] = (
        ("chat", "TTFT p99 <= 1.0x affinity alone", "affinity", ttft_p99, lambda r: r <= 1.0),
        ("chat", "TTFT p99 <= 1.0x consistent hash, no bound", "chash", ttft_p99, lambda r: r <= 1.0),
        ("chat", "turns moved <= 1.5x affinity alone", "affinity", moved, lambda r: r <= 1.5),
        ("mix", "TTFT p99 <= 1.0x affinity alone", "affinity", ttft_p99, lambda r: r <= 1.0),
        ("mix", "TTFT p99 <= 1.0x consistent hash, no bound", "chash", ttft_p99, lambda r: r <= 1.0),
        (
            "overload",
            "TTFT p99 <= 0.2x round robin",
            "round_robin",
            ttft_p99,
            lambda r: r <= 0.2,
            _ttft_floor,
        ),
        (
            "overload",
            "completed req/s >= 1.05x round robin (or the ceiling)",
            "round_robin",
            lambda m: m.requests_per_s,
            lambda r: r >= 1.05,
            _capacity_ceiling,
        ),
        ("hetero", "TTFT p99 <= 1.1x the capacity-weight oracle", ORACLE, ttft_p99, lambda r: r <= 1.1),
    )  # fmt: skip
    keys = sorted(results, key=key_order)
    for key in keys:
        for scenario, *target in paired_targets:
            if split_key(key)[0] == scenario:
                check(key, *target)  # type: ignore[arg-type]
    absolute(
        "slowdown",
        "slowed replica's weight falls within 5 s of the slowdown",
        lambda m: m.weights.slowdown.fell_after if m.weights and m.weights.slowdown else None,
        lambda v: v <= 5.0,
        "{:.1f} s",
    )
    absolute(
        "slowdown",
        "slowed replica's share of new sessions, 5 s after the slowdown, at most half its share before",
        lambda m: _share_drop(m),
        lambda r: r <= 0.5,
        "{:.2f}x",
        _share_evidence,
    )
    check(
        "slowdown",
        "TTFT p99 over the slow period <= 0.5x affinity alone",
        "affinity",
        lambda m: m.slow.ttft_p99_during if m.slow else None,
        lambda r: r <= 0.5,
    )
    check(
        "slowdown",
        "no spike after recovery: TTFT p99 in the 10 s after <= 1.2x affinity alone's",
        "affinity",
        lambda m: m.slow.ttft_p99_after if m.slow else None,
        lambda r: r <= 1.2,
    )
    absolute(
        "mix",
        "load max/mean <= 1.15",
        lambda m: m.load_max_over_mean,
        lambda v: v <= 1.15,
        "{:.2f}",
    )
    absolute(
        "mix",
        "hit rate >= 95% of the oracle's",
        lambda m: m.hit_vs_oracle,
        lambda v: v >= 0.95,
        "{:.2f}",
    )
    return out


def key_order(key: str) -> tuple[int, int, str]:
    """Results keys by batch size, then in the suite's order of scenarios."""
    from bench.routing.scenarios import SCENARIOS

    scenario, batch = split_key(key)
    order = [s.key for s in SCENARIOS]
    return (batch or 0, order.index(scenario) if scenario in order else len(order), key)


def capacity_ceiling(m: Measured) -> float | None:
    """The most completed requests any router could serve with full batches, as a multiple of
    this run's (round robin's): its engines' prompt work cut to what the oracle's hit rate
    leaves, the decode steps (the same for every router) as they were."""
    share, hit, oracle = m.prefill_share, m.engine_hit_rate, m.oracle_hit_rate
    if share is None or hit is None or oracle is None or hit >= 1.0:
        return None
    left = (1.0 - float(oracle)) / (1.0 - float(hit))
    return 1.0 / (1.0 - float(share) * (1.0 - min(1.0, left)))


def _capacity_ceiling(runs: Runs) -> str:
    """The ceiling beside round robin's runs, as the req/s target's evidence."""
    ceilings = [c for m in runs if (c := capacity_ceiling(m)) is not None]
    shares = [m.prefill_share for m in runs if m.prefill_share is not None]
    if not ceilings or not shares:
        return ""
    return (
        f"; ceiling for any router {statistics.median(ceilings):.2f}x (round robin's engines "
        f"spent {statistics.median(shares):.0%} of their time on prompt tokens; the oracle's "
        "hit rate would save the part it caches)"
    )


def _share_drop(m: Measured) -> float | None:
    if m.slow is None:
        return None
    before, after = m.slow.new_share_before, m.slow.new_share_after_5s
    if before is None or after is None or not before:
        return None
    return after / before


PREFILL_PER_TOKEN = 1 / 8000
"""The suite's replicas' prefill time per uncached prompt token (simulated seconds)."""
STEP = 0.012
"""... and the time of one engine step with nothing else in it."""


def ttft_floor(m: Measured) -> float | None:
    """The TTFT p99 this run would have had with no wait at all: each request's uncached
    prompt prefilled alone in one go, with the cache hits it had. No router can go below it
    without more cache hits, whatever its bound."""
    floors = sorted(
        (r.prompt_tokens - r.cached_tokens) * PREFILL_PER_TOKEN + STEP
        for r in m.per_request
        if r.ok and r.prompt_tokens
    )
    if not floors:
        return None
    return floors[min(len(floors) - 1, max(0, round(0.99 * len(floors)) - 1))]


def _ttft_floor(runs: Runs) -> str:
    floors = [f for m in runs if (f := ttft_floor(m)) is not None]
    if not floors:
        return ""
    return f"; its floor (no wait at all, its own cache hits) {statistics.median(floors):.3f} s"


def _floor_ratio(mine: Runs, base: Runs) -> str:
    """The floor as a ratio of the baseline's TTFT p99, paired per seed: the best ratio any
    bound could reach."""
    ratios = [
        f / b.ttft_p99
        for a, b in zip(mine, base, strict=False)
        if (f := ttft_floor(a)) is not None and b.ttft_p99
    ]
    if not ratios:
        return ""
    return f" = {statistics.median(ratios):.2f}x round robin's TTFT p99"


def _share_evidence(runs: Runs) -> str:
    """The new-session share drop with the seeds' counts pooled, and the ring share's drop
    (the chance a new session had), beside the per-seed median: a window's few sessions make
    each seed's ratio coarse."""
    slow = [m.slow for m in runs if m.slow]
    counts = [
        (s.new_sessions_before, s.new_sessions_after_5s)
        for s in slow
        if s.new_sessions_before and s.new_sessions_after_5s
    ]
    text = ""
    if counts and len(counts) == len(slow):
        mine_b, all_b = (sum(before[i] for before, _ in counts) for i in (0, 1))
        mine_a, all_a = (sum(after[i] for _, after in counts) for i in (0, 1))
        if mine_b and all_b and all_a:
            pooled = (mine_a / all_a) / (mine_b / all_b)
            text += (
                f"; seeds pooled {pooled:.2f}x ({mine_b} of {all_b} new sessions before, "
                f"{mine_a} of {all_a} after)"
            )
    rings = [
        d
        for m in runs
        if m.weights
        and m.weights.slowdown
        and (d := m.weights.slowdown.ring_share_drop) is not None
    ]
    if rings:
        text += f"; ring share {statistics.median(rings):.2f}x"
    return text


PER_BATCH: tuple[tuple[str, str, Value], ...] = (
    ("TTFT p99 / affinity", "affinity", lambda m: m.ttft_p99),
    ("/ no bound", "chash", lambda m: m.ttft_p99),
    ("/ fixed bounds", "kvpilot_twin", lambda m: m.ttft_p99),
    ("/ round robin", "round_robin", lambda m: m.ttft_p99),
    ("/ oracle", ORACLE, lambda m: m.ttft_p99),
    ("req/s / round robin", "round_robin", lambda m: m.requests_per_s),
    ("moved / affinity", "affinity", lambda m: float(max(1, m.moved))),
)
"""The per-batch-size summary's ratio columns: (title, baseline policy, value)."""


def per_batch_size(results: SuiteResults) -> list[str]:
    """One row per scenario and batch size: the recommended route's ratios to the policies
    it is compared with (paired per seed, median and spread), its hit rate and how often its
    bounded load changed."""
    rows = []
    for key in sorted(results, key=key_order):
        runs = results[key]
        mine = runs.get(RECOMMENDED)
        if mine is None:
            continue
        scenario, batch = split_key(key)
        cells = [scenario, "" if batch is None else str(batch)]
        for _, base, value in PER_BATCH:
            cells.append(ratio_text(paired(mine, runs[base], value)) if base in runs else "n/a")
        cells.append(cell(mine, lambda m: m.hit_rate, "{:.1%}"))
        cells.append(cell(mine, lambda m: m.bound_changes, "{:.0f}"))
        rows.append(cells)
    if not rows:
        return []
    header = (
        "scenario",
        "batch",
        *(title for title, _, _ in PER_BATCH),
        "hit rate",
        "bound changes",
    )
    return [
        "",
        f"## The recommended route per batch size ({RECOMMENDED})",
        "",
        "Ratios of the recommended route's numbers to another policy's in the same run, "
        "paired seed by seed: median (min-max). Bound changes: how often its session "
        "requests moved to another twin (a route update each) during the replay.",
        "",
        *table(header, rows),
    ]
