"""The regions benchmark's numbers, read from every request's record, and its Markdown
report with the issue's targets beside them."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.regions.config import RegionsConfig
from bench.regions.load import Sent
from bench.regions.marks import Marks
from bench.regions.results import (
    Down,
    Drained,
    LocalBin,
    Offered,
    OverLimit,
    Overload,
    Recovery,
    RegionsRun,
    Served,
    Stats,
    Wave,
)


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _window(records: Iterable[Sent], lo: float, hi: float, fleet: str | None = None) -> list[Sent]:
    return [r for r in records if lo <= r.start < hi and (fleet is None or r.fleet == fleet)]


def _pair(stats: Stats | None) -> str:
    """TTFT p50 / p99 of some requests, or - for none."""
    if stats is None or stats.ttft_p50 is None:
        return "-"
    return f"{_ms(stats.ttft_p50)} / {_ms(stats.ttft_p99)}"


def _stats(records: Sequence[Sent]) -> Stats:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return Stats(
        requests=len(records),
        failed=len(records) - len(ok),
        cross=round(sum(r.crossed for r in ok) / len(ok), 4) if ok else None,
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p99=_quantile(ttfts, 0.99),
    )


def _offered(records: Sequence[Sent], lo: float, hi: float, capacity: float) -> Offered:
    """The load the generator achieved in a window (a busy machine may fall short)."""
    stats = _stats(records)
    rate = len(records) / (hi - lo) if hi > lo else 0.0
    return Offered(**asdict(stats), rate=round(rate, 2), load=round(rate / capacity, 3))


WAVE_LIMIT = 1.5
"""The spot wave's target: TTFT p99 during it at most this many times the p99 before."""


def over_limit(before: Sequence[Sent], during: Sequence[Sent], rtt: float) -> OverLimit | None:
    """The wave's requests over its target's line and what the round trip `rtt` lets cross
    (``OverLimit``); None without a p99 before."""
    at_once = [r.ttft for r in before if r.ok and r.ttft is not None]
    p99 = _quantile(at_once, 0.99)
    if p99 is None:
        return None
    limit = WAVE_LIMIT * p99
    served = [r for r in during if r.ok and r.ttft is not None]
    allowed = len(served) - math.ceil(0.99 * len(served))
    chance = sum(t > limit - rtt for t in at_once) / len(at_once)
    most = None
    if served:
        most = round(min(1.0, allowed / chance / len(served)), 4) if chance else 1.0
    return OverLimit(
        limit_s=round(limit, 4),
        allowed=allowed,
        crossed=sum(r.crossed and (r.ttft or 0.0) > limit for r in served),
        stayed=sum(not r.crossed and (r.ttft or 0.0) > limit for r in served),
        crossing_chance=round(chance, 4),
        most_crossing=most,
    )


def served_excess(config: RegionsConfig, records: Sequence[Sent], lo: float, hi: float) -> Served:
    """Region A's capacity as its replicas showed it in the window, rather than as measured
    at the start (a shared machine slows the simulated replicas as the run goes on): the
    requests its replicas completed per second, the mean number in flight on them against
    their batch slots (at or above 1: full, so the completion rate is the capacity), and the
    excess that follows, (fleet A's rate - that capacity) / fleet A's rate."""
    a = config.regions[0]
    slots = config.replicas * config.sim.max_batch
    done = [r for r in records if r.ok and r.region == a and r.end is not None and lo <= r.end < hi]
    sent = _window(records, lo, hi, a)
    on_a = [r for r in records if r.region == a and r.end is not None]
    samples = []
    t = lo
    while t < hi:
        samples.append(sum(1 for r in on_a if r.start <= t < (r.end or t)))
        t += 0.5
    completed = len(done) / (hi - lo) if hi > lo else 0.0
    offered = len(sent) / (hi - lo) if hi > lo else 0.0
    return Served(
        completed_rps=round(completed, 3),
        in_flight_over_slots=round(statistics.fmean(samples) / slots, 3) if samples else None,
        excess=round(max(0.0, 1 - completed / offered), 4) if offered else None,
    )


def summarize(config: RegionsConfig, marks: Marks, records: Sequence[Sent]) -> RegionsRun:
    """Every number of one policy's run."""
    a, b = config.regions
    lo, hi = marks.phases["steady"]
    lo += (hi - lo) / 4
    steady = {
        f: _offered(_window(records, lo, hi, f), lo, hi, marks.capacity) for f in config.regions
    }
    lo, hi = marks.phases["overload"]
    lo += (hi - lo) / 2
    overloaded = {
        f: _offered(_window(records, lo, hi, f), lo, hi, marks.capacity) for f in config.regions
    }
    # Only the excess should cross: (load - capacity) / load, at the load achieved.
    load = max(overloaded[a].load, 1e-9)
    overload = Overload(
        overloaded,
        round(max(0.0, (load - 1) / load), 4),
        served_excess(config, records, lo, hi),
    )

    lo, hi = marks.phases["down"]
    killed = marks.killed
    in_flight = [r for r in records if r.start < killed and (r.end or hi) > killed]
    after = _window(records, killed, hi, a)
    late_failures = [r.start - killed for r in after if not r.ok]
    down = Down(
        in_flight_at_kill=len(in_flight),
        failed_in_flight=sum(not r.ok for r in in_flight),
        failed_after_kill=len(late_failures),
        last_failure_after_kill_s=max(late_failures, default=0.0),
        fleet_a_after_kill=_stats(after),
        answered_in_a_after_kill=sum(r.region == a for r in after if r.ok),
    )
    lo, hi = marks.phases["recovery"]
    bins = []
    step = 2.0
    t = marks.restarted
    while t < hi:
        batch = [r for r in _window(records, t, t + step, a) if r.ok]
        local = sum(not r.crossed for r in batch) / len(batch) if batch else None
        bins.append(LocalBin(t=round(t - marks.restarted, 1), local=local, n=len(batch)))
        t += step
    recovery = Recovery(bins, _stats(_window(records, lo, hi, b)))

    lo, hi = marks.phases["wave"]
    before = _window(records, lo + 3, marks.notice)
    during = _window(records, marks.notice, marks.gone + 10)
    drained: dict[str, Drained] = {}
    for rid in sorted(marks.learned):
        starts = [r.start for r in records if r.replica == rid and r.start >= marks.notice]
        learned = marks.learned[rid]
        last = max(starts, default=None)
        drained[rid] = Drained(
            learned_after_notice_s=round(learned - marks.notice, 3),
            last_start_after_learned_s=None if last is None else round(last - learned, 3),
        )
    in_wave = _window(records, lo, hi)
    wave = Wave(
        failed=sum(not r.ok for r in in_wave),
        requests=len(in_wave),
        before=_stats(before),
        during=_stats(during),
        drained=drained,
        stayed=_stats([r for r in during if not r.crossed]),
        crossed=_stats([r for r in during if r.crossed]),
        over_limit=over_limit(before, during, config.rtt),
    )
    return RegionsRun(
        service_s=marks.service,
        capacity_rps=marks.capacity,
        steady=steady,
        overload=overload,
        down=down,
        recovery=recovery,
        wave=wave,
    )


def _fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}{unit}"


def _ms(value: float | None) -> str:
    return _fmt(value, " ms", 1000)


def _pct(value: float | None) -> str:
    return _fmt(value, "%", 100, 1)


def write_report(config: RegionsConfig, summary: Mapping[str, RegionsRun], path: Path) -> Path:
    """The Markdown report (and its JSON beside it)."""
    path.write_text(markdown(config, summary))
    path.with_suffix(".json").write_text(json.dumps(_json(summary), indent=1, default=str))
    return path


def _json(summary: Mapping[str, RegionsRun]) -> dict[str, Any]:
    return {policy: run.to_json() for policy, run in summary.items()}


def load(path: Path) -> dict[str, RegionsRun]:
    """Every policy's run from a report's JSON file."""
    return {
        policy: RegionsRun.from_json(run) for policy, run in json.loads(path.read_text()).items()
    }


def markdown(config: RegionsConfig, summary: Mapping[str, RegionsRun]) -> str:
    """The report: every policy's numbers side by side, and all of them as JSON."""
    a, b = config.regions
    policies = list(summary)
    lines = [
        "# Regions, zones and spot capacity",
        "",
        f"Two regions ({a}, {b}) of {config.replicas} simulated replicas (batch of "
        f"{config.sim.max_batch}), one Envoy fleet per region, a simulated inter-region round "
        f"trip of {config.rtt * 1000:.0f} ms. Policies: {', '.join(policies)}.",
        "",
        "| | " + " | ".join(policies) + " |",
        "|---|" + "---|" * len(policies),
    ]

    def row(label: str, get: Callable[[RegionsRun], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(get(summary[p]) for p in policies) + " |")

    row("capacity per region", lambda s: f"{s.capacity_rps:.1f} req/s")
    row(
        "steady: load achieved (A, B)",
        lambda s: f"{_pct(s.steady[a].load)}, {_pct(s.steady[b].load)}",
    )

    def steady(f: str) -> None:
        row(f"steady: cross-region share, fleet {f}", lambda s: _pct(s.steady[f].cross))
        row(f"steady: TTFT p50, fleet {f}", lambda s: _ms(s.steady[f].ttft_p50))
        row(f"steady: TTFT p99, fleet {f}", lambda s: _ms(s.steady[f].ttft_p99))

    for fleet in (a, b):
        steady(fleet)
    row(
        "overload: load achieved (A, B)",
        lambda s: f"{_pct(s.overload.fleets[a].load)}, {_pct(s.overload.fleets[b].load)}",
    )
    row(
        f"overload: cross share of fleet {a} (only the excess: (load - 1) / load)",
        lambda s: f"{_pct(s.overload.fleets[a].cross)} ({_pct(s.overload.expected_cross)})",
    )
    row(
        f"overload: {a}'s replicas: completed per second, in flight / slots",
        lambda s: (
            "n/a"
            if s.overload.served is None
            else f"{s.overload.served.completed_rps:.2f}/s, "
            f"{s.overload.served.in_flight_over_slots}"
        ),
    )
    row(
        f"overload: cross share of fleet {a} (the excess over what {a}'s replicas served)",
        lambda s: (
            f"{_pct(s.overload.fleets[a].cross)} "
            f"({'n/a' if s.overload.served is None else _pct(s.overload.served.excess)})"
        ),
    )
    row(f"overload: TTFT p99, fleet {a}", lambda s: _ms(s.overload.fleets[a].ttft_p99))
    row(f"overload: TTFT p99, fleet {b}", lambda s: _ms(s.overload.fleets[b].ttft_p99))
    row(
        "overload: failed",
        lambda s: str(s.overload.fleets[a].failed + s.overload.fleets[b].failed),
    )
    row("down: requests in flight at the kill", lambda s: str(s.down.in_flight_at_kill))
    row("down: of those failed", lambda s: str(s.down.failed_in_flight))
    row("down: failed, sent after the kill", lambda s: str(s.down.failed_after_kill))
    row(
        "down: last failure after the kill",
        lambda s: _fmt(s.down.last_failure_after_kill_s, " s", 1, 2),
    )
    row(
        f"down: fleet {a} TTFT p50 after the kill",
        lambda s: _ms(s.down.fleet_a_after_kill.ttft_p50),
    )
    row(
        f"recovery: fleet {a} local share, first bins (2 s)",
        lambda s: " ".join(_fmt(x.local, "", 100, 0) for x in s.recovery.fleet_a_local_share[:8]),
    )
    row("spot wave: requests / failed", lambda s: f"{s.wave.requests} / {s.wave.failed}")
    row("spot wave: TTFT p99 before", lambda s: _ms(s.wave.before.ttft_p99))
    row("spot wave: TTFT p99 during", lambda s: _ms(s.wave.during.ttft_p99))
    row(
        "spot wave: during, p99 over before",
        lambda s: (
            f"{s.wave.during.ttft_p99 / s.wave.before.ttft_p99:.2f}x"
            if s.wave.during.ttft_p99 and s.wave.before.ttft_p99
            else "-"
        ),
    )
    row("spot wave: during, cross-region share", lambda s: _fmt(s.wave.during.cross, "%", 100, 1))
    row(
        "spot wave: during, TTFT p50 / p99 of those that stayed",
        lambda s: _pair(s.wave.stayed),
    )
    row(
        "spot wave: during, TTFT p50 / p99 of those that crossed",
        lambda s: _pair(s.wave.crossed),
    )
    row(
        f"spot wave: during, over {WAVE_LIMIT}x before: crossed, stayed (the p99 allows)",
        lambda s: f"{o.crossed}, {o.stayed} ({o.allowed})" if (o := s.wave.over_limit) else "-",
    )
    row(
        "spot wave: a crossing request over it (its TTFT at once plus the round trip); "
        "the most that may cross",
        lambda s: (
            f"{_pct(o.crossing_chance)}; {_pct(o.most_crossing)}"
            if (o := s.wave.over_limit)
            else "-"
        ),
    )
    row(
        "spot wave: last start on a drained replica after kvpilot learned",
        lambda s: (
            ", ".join(
                f"{rid} {_fmt(v.last_start_after_learned_s, ' s', 1, 2)}"
                for rid, v in s.wave.drained.items()
            )
            or "-"
        ),
    )
    lines += ["", "```json", json.dumps(_json(summary), indent=1, default=str)[:20000], "```", ""]
    return "\n".join(lines)


__all__ = ["WAVE_LIMIT", "load", "markdown", "over_limit", "summarize", "write_report"]
