"""The service-class benchmark's numbers: per class and policy, the issue's targets as met /
not met rows, and the Markdown report (pure, no I/O).

TTFT is the engine's own (arrival at the replica to first token, simulated seconds), as in
the routing suite: on a busy 2-core machine the load generator's HTTP path adds seconds to
every policy alike, which is noise here, not routing. The client-side p99 is reported beside
it. A shed request never reaches a replica, so shedding cannot flatter the engine's TTFT of
the requests that were served.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from bench.classes.config import (
    BATCH,
    CLASS_POLICIES,
    INTERACTIVE,
    POLICIES,
    REFERENCE,
    ClassesCalibration,
    ClassesConfig,
    class_of,
)
from bench.classes.results import ClassRow, PhaseRow, PolicyRun
from bench.classes.signals import admission_summary, signals_markdown
from bench.rig.loadgen import RequestResult
from bench.rig.report import json_block, num, table
from bench.rig.summary import percentile

SATURATED_RUNNING = 0.9
"""Share of ``max_batch`` the mean replica must run, with requests waiting, for a sample to
count as a saturated fleet (`engine_phases`)."""


def ttft_of(result: RequestResult) -> float | None:
    """The engine's time to first token, else the client's (servers that do not report it)."""
    return result.engine_ttft if result.engine_ttft is not None else result.ttft


def _met(result: RequestResult, objective: float, client_side: bool) -> bool:
    ttft = result.ttft if client_side else ttft_of(result)
    return result.ok and ttft is not None and ttft <= objective


def summarize(results: list[RequestResult], config: ClassesConfig) -> PolicyRun:
    """Per class and overall: TTFT, goodput, shed, errors; and the time to recover. Requests
    started in the ramp count in none of them."""
    measured = [r for r in results if r.start >= config.ramp]
    total = config.duration - config.ramp
    overload_start, overload_end = config.window(config.peak.name)
    classes: dict[str, ClassRow] = {}
    misses: list[float] = []
    good_total = 0
    for name in (INTERACTIVE, BATCH):
        mine = [r for r in measured if class_of(r) == name]
        ok = [r for r in mine if r.ok]
        shed = [r for r in mine if r.status == 429]
        errors = [r for r in mine if not r.ok and r.status != 429]
        ttfts = [t for r in ok if (t := ttft_of(r)) is not None]
        client_side = name in config.client_ttft_classes
        good = [r for r in ok if _met(r, config.objectives[name], client_side)]
        good_total += len(good)
        good_ids = {id(r) for r in good}
        misses += [r.start for r in mine if id(r) not in good_ids]
        by_phase: dict[str, PhaseRow] = {}
        for phase in config.phases:
            if not phase.measured:
                continue
            start, end = config.window(phase.name)
            inside = [t for r in ok if start <= r.start < end and (t := ttft_of(r)) is not None]
            by_phase[phase.name] = PhaseRow(
                requests=sum(1 for r in mine if start <= r.start < end),
                shed=sum(1 for r in shed if start <= r.start < end),
                ttft_p99=percentile(inside, 99),
            )
        classes[name] = ClassRow(
            requests=len(mine),
            ok=len(ok),
            shed=len(shed),
            diverted=0,
            errors=len(errors),
            error_kinds=sorted({r.error for r in errors})[:5],
            ttft_p50=percentile(ttfts, 50),
            ttft_p99=percentile(ttfts, 99),
            client_ttft_p99=percentile([r.ttft for r in ok if r.ttft is not None], 99),
            met_objective=len(good),
            goodput_per_s=len(good) / total,
            by_phase=by_phase,
        )
    late = [start for start in misses if start >= overload_end]
    return PolicyRun(
        classes=classes,
        goodput_per_s=good_total / total,
        recovery_s=(max(late) - overload_end) if late else 0.0,
        # The ramp counts here too: the fleet has room all along until the overload.
        shed_in_calm_phase=sum(1 for r in results if r.status == 429 and r.start < overload_start),
        per_request=list(results),
    )


def slower_by_phase(
    per_request: Sequence[RequestResult], bound: float, config: ClassesConfig
) -> dict[str, int]:
    """How many served interactive requests of each measured phase took longer than `bound`
    (engine TTFT, simulated seconds) to their first token."""
    counts: dict[str, int] = {}
    for row in per_request:
        ttft = row.engine_ttft if row.engine_ttft is not None else row.ttft
        phase = config.phase_at(row.start)
        if (
            class_of(row) == INTERACTIVE
            and row.status == 200
            and row.start >= config.ramp
            and phase is not None
            and ttft is not None
            and ttft > bound
        ):
            counts[phase] = counts.get(phase, 0) + 1
    return counts


def engine_phases(
    samples: Sequence[dict[str, float]], config: ClassesConfig
) -> dict[str, dict[str, float | None]]:
    """The engines' own counters per phase, from `SignalSampler` samples: mean requests
    running and waiting per replica, and the share of samples in which the mean replica ran
    a full batch (``max_batch``) with requests waiting. The overload must saturate the fleet
    and the calm phases must not, or the benchmark measures nothing."""
    max_batch = config.routing.sim.max_batch
    out: dict[str, dict[str, float | None]] = {}
    for phase in config.phases:
        start, end = config.window(phase.name)
        inside = [s for s in samples if start <= s["at"] < end and "running" in s]
        running = [s["running"] for s in inside]
        waiting = [s["waiting"] for s in inside]
        out[phase.name] = {
            "samples": len(inside),
            "running": statistics.fmean(running) if running else None,
            "waiting": statistics.fmean(waiting) if waiting else None,
            "kv_cache": statistics.fmean(s["kv_cache"] for s in inside) if inside else None,
            "saturated_share": (
                sum(
                    1
                    for s in inside
                    if s["running"] >= SATURATED_RUNNING * max_batch and s["waiting"] > 0
                )
                / len(inside)
                if inside
                else None
            ),
        }
    return out


def targets(results: Mapping[str, PolicyRun]) -> list[tuple[str, bool | None, str]]:
    """The issue's targets, side by side from one run: (what, met?, measured), for each
    policy with service classes in `results`."""
    ref = _p99(results, "reference")
    titles = {p.key: p.title for p in POLICIES}
    rows: list[tuple[str, bool | None, str]] = []
    variants = [key for key in CLASS_POLICIES if key in results] or ["classes"]
    alone = _ratio(_p99(results, "affinity"), ref)
    for number, key in enumerate(variants):
        who = "" if len(variants) == 1 else f" ({titles[key]})"
        ratio = _ratio(_p99(results, key), ref)
        rows.append(
            (
                f"interactive TTFT p99 with service classes within 1.5x of no batch at all{who}",
                None if ratio is None else ratio <= 1.5,
                f"{num(ratio, '{:.2f}')}x ({num(_p99(results, key))}s vs {num(ref)}s)",
            )
        )
        if number == 0:
            rows.append(
                (
                    "affinity alone lets it grow past 5x",
                    None if alone is None else alone > 5,
                    f"{num(alone, '{:.2f}')}x ({num(_p99(results, 'affinity'))}s)",
                )
            )
        run, affinity = results.get(key), results.get("affinity")
        goodput = None if run is None else run.goodput_per_s
        goodput_alone = None if affinity is None else affinity.goodput_per_s
        rows.append(
            (
                f"total goodput with classes at least affinity alone's{who}",
                None if goodput is None or goodput_alone is None else goodput >= goodput_alone,
                f"{num(goodput, '{:.2f}')}/s vs {num(goodput_alone, '{:.2f}')}/s",
            )
        )
        batch = None if run is None else run.classes.get(BATCH)
        rows.append(
            (
                f"batch work that is admitted completes{who}",
                None if batch is None else batch.errors == 0,
                "n/a"
                if batch is None
                else f"{batch.ok} of {batch.requests - batch.shed} admitted completed, "
                f"{batch.errors} errors",
            )
        )
        calm = None if run is None else run.shed_in_calm_phase
        rows.append(
            (
                f"nothing is shed when the fleet has room (the calm first phase){who}",
                None if calm is None else calm == 0,
                f"{calm} shed",
            )
        )
    return rows


def _p99(results: Mapping[str, PolicyRun], key: str) -> float | None:
    run = results.get(key)
    row = None if run is None else run.classes.get(INTERACTIVE)
    return None if row is None else row.ttft_p99


def _phase_p99(phases: Mapping[str, PhaseRow], name: str) -> float | None:
    row = phases.get(name)
    return None if row is None else row.ttft_p99


def _phase_requests(phases: Mapping[str, PhaseRow], name: str) -> int:
    row = phases.get(name)
    return 0 if row is None else row.requests


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def markdown(
    results: Mapping[str, PolicyRun], config: ClassesConfig, calibration: ClassesCalibration
) -> str:
    titles = {p.key: p.title for p in (REFERENCE, *POLICIES)}
    phases = ", ".join(
        f"{p.name} {p.duration:g}s (interactive {p.interactive:.0%} + batch {p.batch:.0%})"
        for p in config.phases
    )
    lines = [
        "# Service classes under overload",
        "",
        f"{config.replicas} simulated replicas behind one real Envoy configured by kvpilot. "
        f"Phases (simulated seconds): {phases}; the first {config.ramp:g}s are not "
        "measured. TTFT objectives: interactive "
        f"{config.objectives[INTERACTIVE]:g}s, batch {config.objectives[BATCH]:g}s. Times in "
        "simulated seconds; TTFT as the engines timed it (client-side p99 beside it).",
        "",
    ]
    lines += table(
        (
            "policy", "class", "requests", "ok", "shed", "diverted", "errors", "TTFT p50",
            "TTFT p99", "client p99", "goodput/s",
        ),
        (
            (
                titles[key], name, row.requests, row.ok, row.shed, row.diverted,
                row.errors, num(row.ttft_p50), num(row.ttft_p99),
                num(row.client_ttft_p99), f"{row.goodput_per_s:.2f}",
            )
            for key, summary in results.items()
            for name, row in summary.classes.items()
            if row.requests
        ),
        "llrrrrrrrrr",
    )  # fmt: skip
    overload = config.window(config.peak.name)
    lines.append("")
    lines += table(
        ("policy", "total goodput/s", "time to recover (s)", "admission"),
        (
            (
                titles[key],
                f"{summary.goodput_per_s:.2f}",
                f"{summary.recovery_s:.1f}",
                admission_summary(summary.admission, overload),
            )
            for key, summary in results.items()
        ),
        "lrrl",
    )
    measured_phases = [phase.name for phase in config.phases if phase.measured]
    lines += [
        "",
        "Interactive TTFT p99 by phase (engine, simulated seconds; requests in brackets):",
        "",
    ]
    by_phase = {key: summary.classes[INTERACTIVE].by_phase for key, summary in results.items()}
    lines += table(
        ("policy", *measured_phases),
        (
            (
                titles[key],
                *(
                    f"{num(_phase_p99(phases, name))} ({_phase_requests(phases, name)})"
                    for name in measured_phases
                ),
            )
            for key, phases in by_phase.items()
        ),
        "l" + "r" * len(measured_phases),
    )
    ref = _p99(results, "reference")
    if ref is not None:
        bound = 1.5 * ref
        lines += [
            "",
            f"Interactive requests slower than 1.5x the reference's p99 ({bound:.3f}s), by "
            "phase: the target leaves 1% of the requests for it. Those of the phases with "
            "room are what the batch admitted there costs (nothing may be shed then).",
            "",
        ]
        slower = {
            key: slower_by_phase(summary.per_request, bound, config)
            for key, summary in results.items()
        }
        lines += table(
            ("policy", *measured_phases, "in all"),
            (
                (
                    titles[key],
                    *(counts.get(name, 0) for name in measured_phases),
                    sum(counts.values()),
                )
                for key, counts in slower.items()
            ),
            "l" + "r" * (len(measured_phases) + 1),
        )
    lines += [
        "",
        f"The engines' own counters per phase (means over the replicas; a sample is saturated "
        f"when the mean replica runs {SATURATED_RUNNING:.0%} of its {config.routing.sim.max_batch}"
        "-sequence batch or more with requests waiting):",
        "",
    ]
    lines += table(
        (
            "policy", "phase", "running/replica", "waiting/replica", "KV-cache use",
            "saturated samples",
        ),
        (
            (
                titles[key], name, num(row.get("running"), "{:.1f}"),
                num(row.get("waiting"), "{:.2f}"), num(row.get("kv_cache"), "{:.2f}"),
                num(row.get("saturated_share"), "{:.0%}"),
            )
            for key, summary in results.items()
            for name, row in summary.engines.items()
        ),
        "llrrrr",
    )  # fmt: skip
    lines += ["", "## Targets", ""]
    lines += table(
        ("target", "met", "measured"),
        (
            (what, "n/a" if met is None else ("met" if met else "not met"), measured)
            for what, met, measured in targets(results)
        ),
    )
    affinity = results.get("affinity")
    signals = None if affinity is None else affinity.signals
    if signals:
        lines += ["", *signals_markdown(signals, config)]
    lines += [
        "",
        "Time to recover: from the end of the overload to the start of the last request that "
        "was shed or missed its class's objective.",
        "",
        "Calibration (rates found for each phase's share of cache-blind capacity):",
        "",
        *json_block(calibration.to_json()),
    ]
    return "\n".join(lines)
