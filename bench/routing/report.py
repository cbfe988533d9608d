"""The scenario suite's report: one table per scenario (median and spread over seeds), the
issue's targets checked on the recommended policy (`bench.routing.targets`), a JSON file and
every request."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.rig.report import table
from bench.rig.routes import Policy
from bench.routing.measure import goodput
from bench.routing.results import Measured, ScenarioWorkload, SlowPeriod, SuiteResults
from bench.routing.scenarios import (
    RECOMMENDED,
    SuiteConfig,
    config_dict,
    dump,
    median_spread,
    split_key,
)
from bench.routing.targets import (
    Value,
    cell,
    key_order,
    paired,
    per_batch_size,
    pooled_p99,
    pooled_ratio,
    ratio_text,
    targets,
)

COLUMNS: tuple[tuple[str, str, Value], ...] = (
    ("TTFT p50", "{:.3f}", lambda m: m.ttft_p50),
    ("TTFT p99", "{:.3f}", lambda m: m.ttft_p99),
    ("E2E p99", "{:.2f}", lambda m: m.latency_p99),
    ("req/s", "{:.2f}", lambda m: m.requests_per_s),
    ("goodput/s", "{:.2f}", lambda m: m.goodput_per_s),
    ("hit rate", "{:.1%}", lambda m: m.hit_rate),
    ("hit / oracle", "{:.2f}", lambda m: m.hit_vs_oracle),
    ("load max/mean", "{:.2f}", lambda m: m.load_max_over_mean),
    ("turns moved", "{:.1%}", lambda m: m.moved_share),
    ("errors", "{:.0f}", lambda m: m.errors),
    ("weight changes", "{:.0f}", lambda m: m.weights.weight_changes if m.weights else None),
    ("bound changes", "{:.0f}", lambda m: m.bound_changes),
)

Workloads = dict[str, list[ScenarioWorkload]]
"""Each scenario key's workloads, one per seed."""


def _measured_seeds(results: SuiteResults) -> list[int]:
    """The seeds some scenario finished (a stopped run reports what it measured)."""
    return sorted({m.seed for by in results.values() for runs in by.values() for m in runs})


def markdown(
    config: SuiteConfig,
    policies: Sequence[Policy],
    workloads: Workloads,
    results: SuiteResults,
    written: str | None = None,
) -> str:
    """The report; `written` is the time it names (now by default)."""
    titles = {p.key: p.title for p in policies}
    scenarios = {s.key: s for s in config.scenarios}
    lines = [
        "# kvpilot routing scenarios",
        "",
        f"{written or time.strftime('%Y-%m-%d %H:%M:%S')}. {config.replicas} simulated vLLM "
        "replicas per "
        "policy; every policy replays the same workload at the same time through one real Envoy "
        f"configured by kvpilot. Seeds {', '.join(map(str, _measured_seeds(results)))} "
        f"(of {', '.join(map(str, config.seeds))} asked for): each cell is the "
        "median (min-max over seeds). Times are simulated seconds (wall time / "
        f"{config.sim.time_scale}). Goodput: requests with TTFT <= {config.slo_ttft:g} s, per "
        "second. Turns moved: later turns of a session answered by another replica than the "
        "turn before. Load max/mean: the busiest replica's mean in-flight requests over the "
        "fleet's mean.",
    ]
    header = ("policy", *(name for name, _, _ in COLUMNS))
    for key in sorted(results, key=key_order):
        by_policy = results[key]
        scenario = scenarios[split_key(key)[0]]
        batch = split_key(key)[1]
        summaries = workloads.get(key, [])
        oracle = median_spread([w.oracle_hit_rate for w in summaries])
        requests = median_spread([w.workload.requests for w in summaries])
        lines += [
            "",
            f"## {scenario.title}"
            + ("" if batch is None else f", batch size {batch}")
            + f" (`{key}`)",
            "",
            f"{requests[0]:.0f} requests per seed (median), offered load "
            f"{scenario.load:.0%} of the fleet's cache-blind capacity, oracle hit rate "
            f"{oracle[0]:.1%}."
            if requests and oracle
            else "",
            "",
        ]
        lines += table(
            header,
            (
                (
                    titles.get(policy, policy),
                    *(cell(runs, value, pattern) for _, pattern, value in COLUMNS),
                )
                for policy, runs in by_policy.items()
            ),
        )
        pooled = [
            f"{titles.get(policy, policy)} {value:.3f} s"
            for policy, runs in by_policy.items()
            if (value := pooled_p99(runs)) is not None
        ]
        if len(by_policy[next(iter(by_policy))]) > 1 and pooled:
            lines += [
                "",
                "TTFT p99 over the requests of all seeds pooled: " + "; ".join(pooled) + ".",
            ]
        if scenario.event is not None:
            lines.append("")
            lines += table(
                (
                    "policy", "TTFT p99 before", "during", "10 s after",
                    "new-session share before", "first 5 s", "after 5 s", "recovered",
                ),
                (
                    (titles.get(policy, policy), *_slow_cells([m.slow for m in runs if m.slow]))
                    for policy, runs in by_policy.items()
                ),
            )  # fmt: skip
        if "affinity" in by_policy and "affinity_copy" in by_policy:
            noise = paired(by_policy["affinity_copy"], by_policy["affinity"], lambda m: m.ttft_p99)
            moved_noise = paired(
                by_policy["affinity_copy"], by_policy["affinity"], lambda m: m.moved
            )
            lines += [
                "",
                f"Noise (A/A): the second copy of affinity alone at {ratio_text(noise)} of the "
                "first's TTFT p99 (all seeds pooled: "
                f"{pooled_ratio(by_policy['affinity_copy'], by_policy['affinity'])}), and at "
                f"{ratio_text(moved_noise)} of its turns moved.",
            ]
    lines += per_batch_size(results)
    check = targets(results)
    if check:
        lines += [
            "",
            f"## Targets for the recommended policy ({titles.get(RECOMMENDED, RECOMMENDED)})",
            "",
            "Ratios are paired seed by seed (both policies replayed the same workload at the same "
            "time): median (min-max).",
            "",
        ]
        lines += table(
            ("scenario", "target", "met", "measured"),
            (
                (key, claim, "n/a" if met is None else ("met" if met else "NOT met"), measured)
                for key, claim, met, measured in check
            ),
        )
    return "\n".join(lines) + "\n"


def _slow_cells(slow: list[SlowPeriod]) -> list[str]:
    """The slowdown table's cells for one policy's runs (their ``slow`` sections)."""
    return [
        cell(slow, lambda s: s.ttft_p99_before, "{:.3f}"),
        cell(slow, lambda s: s.ttft_p99_during, "{:.3f}"),
        cell(slow, lambda s: s.ttft_p99_after, "{:.3f}"),
        cell(slow, lambda s: s.new_share_before, "{:.0%}"),
        cell(slow, lambda s: s.new_share_first_5s, "{:.0%}"),
        cell(slow, lambda s: s.new_share_after_5s, "{:.0%}"),
        cell(slow, lambda s: s.new_share_recovered, "{:.0%}"),
    ]


def write_suite_report(
    config: SuiteConfig,
    policies: Sequence[Policy],
    workloads: Workloads,
    results: SuiteResults,
    stamp: str | None = None,
) -> Path:
    """Write scenarios-<stamp>.md, .json and -requests.json under the output directory (the
    stamp is the time by default)."""
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    report = out_dir / f"scenarios-{stamp}.md"
    report.write_text(markdown(config, policies, workloads, results))
    dump(
        report.with_suffix(".json"),
        {
            "config": config_dict(config),
            "workloads": {key: [w.to_json() for w in seeds] for key, seeds in workloads.items()},
            "results": {
                scenario: {policy: [m.to_json() for m in runs] for policy, runs in by.items()}
                for scenario, by in results.items()
            },
            "targets": [
                {"scenario": s, "target": t, "met": met, "measured": text}
                for s, t, met, text in targets(results)
            ],
        },
    )
    dump(
        out_dir / f"scenarios-{stamp}-requests.json",
        {
            scenario: {
                policy: [[r.to_json() for r in m.per_request] for m in runs]
                for policy, runs in by_policy.items()
            }
            for scenario, by_policy in results.items()
        },
    )
    return report


@dataclass(frozen=True)
class SuiteRun:
    """A finished run read back from its files: what its report is rendered from."""

    config: SuiteConfig
    policies: list[Policy]
    workloads: Workloads
    results: SuiteResults


def load(report_json: Path, slo_ttft: float | None = None) -> SuiteRun:
    """A run from its JSON and requests files (with another goodput objective if given;
    goodput is then counted again from the requests)."""
    from bench.routing.scenarios import SCENARIOS, SUITE_POLICIES
    from replicasim.simulator import SimConfig

    data = json.loads(report_json.read_text())
    requests = json.loads(report_json.with_name(report_json.stem + "-requests.json").read_text())
    raw = data["config"]
    slo = raw["slo_ttft"] if slo_ttft is None else slo_ttft
    scenarios = {s.key: s for s in SCENARIOS}
    named = dict.fromkeys(split_key(key)[0] for key in data["results"])
    config = SuiteConfig(
        replicas=raw["replicas"],
        sim=SimConfig(**raw["sim"]),
        batch_sizes=tuple(raw.get("batch_sizes", (raw["sim"]["max_batch"],))),
        scenarios=tuple(scenarios[key] for key in named),
        policies=tuple(raw["policies"]),
        seeds=tuple(raw["seeds"]),
        slo_ttft=slo,
        out_dir=report_json.parent,
    )
    results: SuiteResults = {}
    for scenario, by_policy in data["results"].items():
        for policy, runs in by_policy.items():
            for entry, per_request in zip(runs, requests[scenario][policy], strict=True):
                measured = Measured.from_json(entry, per_request)
                good = goodput(measured.per_request, slo, measured.makespan_s)
                measured = replace(measured, goodput_per_s=good.per_s, goodput_share=good.share)
                results.setdefault(scenario, {}).setdefault(policy, []).append(measured)
    workloads = {
        key: [ScenarioWorkload.from_json(w) for w in seeds]
        for key, seeds in data["workloads"].items()
    }
    policies = [p for p in SUITE_POLICIES if p.key in config.policies]
    return SuiteRun(config, policies, workloads, results)


def rerender(report_json: Path, slo_ttft: float | None = None) -> Path:
    """Write a run's report again from its JSON and requests files (with another goodput
    objective if given): for reading a finished run in another way without running it again.
    Recomputes goodput; every other number comes from the JSON (completed requests also
    count requests of the ramp-up that finished in the measured window, which the requests
    file does not hold)."""
    run = load(report_json, slo_ttft)
    return write_suite_report(run.config, run.policies, run.workloads, run.results)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=rerender.__doc__)
    parser.add_argument("report_json", type=Path)
    parser.add_argument("--slo", type=float, default=None, help="TTFT objective, seconds")
    args = parser.parse_args()
    print(rerender(args.report_json, args.slo))
