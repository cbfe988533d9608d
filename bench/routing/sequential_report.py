"""The routing benchmark's outputs: a Markdown report, a JSON file and PNG plots."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.rig.analysis import TailBreakdown, describe, tail_breakdown
from bench.rig.report import json_block, num, table
from bench.rig.summary import Summary
from bench.rig.workload import WorkloadSummary
from bench.routing.results import Calibration
from replicasim.simulator import SimConfig

BASELINE = "round_robin"
KVPILOT = "affinity"


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


@dataclass(frozen=True)
class TelemetryMoves:
    """What kvpilot did with a telemetry policy's replicas during its replay."""

    weight_changes: float
    telemetry_pushes: float
    weights_at_end: dict[str, float]


@dataclass(frozen=True)
class PolicyResult:
    """One policy's replay: its numbers, and what kvpilot's telemetry did and where the
    slowest first tokens came from beside them. The JSON file's ``policies[key]`` holds the
    three side by side in one object."""

    summary: Summary
    telemetry: TelemetryMoves | None = None
    """Telemetry policies only."""
    tail: TailBreakdown | None = None
    """None before the report is written, or when no request succeeded."""

    def to_json(self) -> dict[str, Any]:
        out = self.summary.to_json()
        if self.telemetry is not None:
            out["telemetry"] = asdict(self.telemetry)
        out["tail"] = {} if self.tail is None else self.tail.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PolicyResult:
        telemetry = data.get("telemetry")
        return cls(
            Summary.from_json(data),
            None if telemetry is None else TelemetryMoves(**telemetry),
            TailBreakdown.from_json(data.get("tail") or {}),
        )


def targets(
    results: Mapping[str, PolicyResult], oracle: float
) -> list[tuple[str, bool | None, str]]:
    """The issue's targets for kvpilot's policy: (what, met?, measured)."""
    mine = results.get(KVPILOT)
    base = results.get(BASELINE)
    if mine is None:
        return []
    hit = mine.summary.hit_rate
    p99 = _ratio(mine.summary.ttft_p99, base.summary.ttft_p99 if base else None)
    load = mine.summary.load_max_over_mean
    return [
        (
            "hit rate >= 90% of the oracle's",
            None if hit is None or not oracle else hit / oracle >= 0.9,
            f"{num(hit and hit / oracle if oracle else None, '{:.1%}')} of the oracle",
        ),
        (
            "TTFT p99 <= 1/3 of round robin's",
            None if p99 is None else p99 <= 1 / 3,
            f"{num(p99, '{:.3f}')}x round robin",
        ),
        (
            "max/mean per-replica load <= 1.3",
            None if load is None else load <= 1.3,
            num(load, "{:.2f}"),
        ),
    ]


@dataclass
class WorkloadGroup:
    """One workload's results: its own baseline (round robin) and its own oracle."""

    name: str
    summary: WorkloadSummary
    calibration: Calibration
    oracle: float
    results: dict[str, PolicyResult]

    @property
    def baseline(self) -> Summary | None:
        """The group's round-robin result (the first policy when there is none)."""
        for key, result in self.results.items():
            if key.endswith(BASELINE):
                return result.summary
        first = next(iter(self.results.values()), None)
        return None if first is None else first.summary


def _table(group: WorkloadGroup, titles: dict[str, str]) -> list[str]:
    base = group.baseline
    header = (
        "policy", "hit rate", "vs oracle", "TTFT p50", "TTFT p90", "TTFT p99", "tokens/s",
        "p50 vs RR", "p99 vs RR", "tokens/s vs RR", "load max/mean", "served max/mean", "busy",
        "errors",
    )  # fmt: skip
    rows = [
        [
            titles.get(key, key),
            num(r.hit_rate, "{:.1%}"),
            num(_ratio(r.hit_rate, group.oracle), "{:.2f}"),
            num(r.ttft_p50, "{:.3f}s"),
            num(r.ttft_p90, "{:.3f}s"),
            num(r.ttft_p99, "{:.3f}s"),
            num(r.throughput_tokens_per_s, "{:.0f}"),
            num(_ratio(r.ttft_p50, base.ttft_p50 if base else None), "{:.2f}x"),
            num(_ratio(r.ttft_p99, base.ttft_p99 if base else None), "{:.2f}x"),
            num(
                _ratio(r.throughput_tokens_per_s, base.throughput_tokens_per_s if base else None),
                "{:.2f}x",
            ),
            num(r.load_max_over_mean, "{:.2f}"),
            num(r.served_max_over_mean, "{:.2f}"),
            num(r.busy_fraction_mean, "{:.0%}"),
            f"{r.errors}/{r.requests}",
        ]
        for key, r in ((key, result.summary) for key, result in group.results.items())
    ]
    oracle = ["oracle (perfect affinity, infinite cache)", f"{group.oracle:.1%}", "1.00"]
    rows.append(oracle + ["n/a"] * (len(header) - len(oracle)))
    return table(header, rows)


def _workload_line(summary: WorkloadSummary, calibration: Calibration) -> str:
    return (
        f"{summary.kind}, {summary.requests} requests, {summary.sessions} chat sessions "
        f"({summary.turns_mean:.1f} turns on average), "
        f"{summary.document_requests} document requests, {summary.arrival} arrivals "
        f"(seed {summary.seed}); prompts {summary.prompt_tokens_mean:.0f} tokens on "
        f"average (p50 {summary.prompt_tokens_p50:.0f}, max "
        f"{summary.prompt_tokens_max}), answers {summary.answer_tokens_mean:.0f} (max "
        f"{summary.answer_tokens_max}). Offered load: "
        f"{calibration.estimated_cache_blind_load:.0%} of the cluster's estimated "
        "cache-blind capacity."
    )


def markdown(
    *,
    groups: list[WorkloadGroup],
    titles: dict[str, str],
    config_dict: dict[str, Any],
    plots: list[str],
    written: str | None = None,
) -> str:
    """The report; `config_dict` is the run's setup as its JSON file holds it, `written` the
    time the report names (now by default)."""
    sim = config_dict["sim"]
    lines = [
        "# kvpilot routing benchmark",
        "",
        f"{written or time.strftime('%Y-%m-%d %H:%M:%S')}. Each workload replayed through a real Envoy "
        f"configured by kvpilot, once per policy, against {config_dict['replicas']} simulated "
        "vLLM replicas (prefix caches reset between policies). Times are simulated GPU seconds "
        f"(wall time / time scale {sim['time_scale']}).",
    ]
    for group in groups:
        lines += [
            "",
            f"## Workload: {group.name}",
            "",
            _workload_line(group.summary, group.calibration),
            "",
            *_table(group, titles),
        ]
    lines += [
        "",
        "hit rate: prefix-cache hit tokens over prompt tokens, from the replicas' "
        "`vllm:prefix_cache_*` counters. load max/mean: the busiest replica's mean in-flight "
        "requests (running + waiting, sampled every 0.5 s) over the replicas' average; served: "
        "the same for request counts. busy: share of time the simulated engines were stepping. "
        "Ratios are to the same workload's round robin.",
    ]
    for group in groups:
        for key, result in group.results.items():
            if (t := result.telemetry) is not None:
                lines.append(
                    f"- {titles.get(key, key)}: kvpilot changed endpoint weights "
                    f"{t.weight_changes:.0f} times from telemetry during the run "
                    f"({t.telemetry_pushes:.0f} pushes); weights at the end "
                    f"{t.weights_at_end}."
                )
            r = result.summary
            if r.errors or r.timed_out:
                lines.append(
                    f"- {titles.get(key, key)}: {r.errors} errors {r.error_kinds}"
                    + (", stopped at the deadline" if r.timed_out else "")
                )
    chat = next((g for g in groups if KVPILOT in g.results), None)
    check = targets(chat.results, chat.oracle) if chat else []
    if check:
        lines += ["", "## Targets for kvpilot (issue 7)", ""]
        for what, met, measured in check:
            mark = "n/a" if met is None else ("met" if met else "NOT met")
            lines.append(f"- {what}: {mark} ({measured})")
    breakdowns = [
        (titles.get(key, key), r.tail) for g in groups for key, r in g.results.items() if r.tail
    ]
    if breakdowns:
        lines += [
            "",
            "## Where the slowest first tokens come from",
            "",
            "Each request's TTFT split into its own prefill (uncached tokens at the "
            "simulator's cost, in chunks of the step budget) and waiting (queue, and steps "
            "shared with other prefills). Kinds: first turn of a session (every document request "
            "is one); moved (a later turn on another replica than the previous turn); evicted "
            "(same replica, history missing); warm (history found). With a few hundred "
            "requests the p99 is the slowest handful: read it with the p90 column.",
            "",
        ]
        for title, breakdown in breakdowns:
            lines += describe(title, breakdown)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines += ["", "## Setup", "", *json_block(config_dict, indent=2)]
    return "\n".join(lines)


def _plots(
    out_dir: Path, stamp: str, results: dict[str, Summary], titles: dict[str, str]
) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')", flush=True)
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, r in results.items():
        values = sorted(r.ttfts)
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.plot(values, ys, label=titles.get(key, key))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (simulated s, log)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT distribution by policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path = out_dir / f"routing-{stamp}-ttft.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))

    fig, axes = plt.subplots(len(results), 1, figsize=(7, 2.2 * max(1, len(results))), sharex=True)
    if len(results) == 1:
        axes = [axes]
    for ax, (key, r) in zip(axes, results.items(), strict=True):
        series = r.load_series
        for rid in r.mean_in_flight:
            ax.plot([s["at"] for s in series], [s.get(rid, 0) for s in series], label=rid, lw=0.8)
        ax.set_title(f"{titles.get(key, key)}: in-flight requests per replica", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7, ncol=4)
    axes[-1].set_xlabel("simulated seconds into the run")
    path = out_dir / f"routing-{stamp}-load.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))
    return paths


def write_report(
    *,
    out_dir: Path,
    plots: bool,
    groups: list[WorkloadGroup],
    titles: dict[str, str],
    config_dict: dict[str, Any],
) -> Path:
    """Write routing-<time>.md/.json (and PNGs, and every request's measurements in
    routing-<time>-requests.json) under the output directory; return the .md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sim = SimConfig(**config_dict["sim"])
    groups = [
        replace(
            g,
            results={
                key: replace(r, tail=tail_breakdown(r.summary.per_request, sim))
                for key, r in g.results.items()
            },
        )
        for g in groups
    ]
    results = {key: r for g in groups for key, r in g.results.items()}
    summaries = {key: r.summary for key, r in results.items()}
    pngs = _plots(out_dir, stamp, summaries, titles) if plots and results else []
    text = markdown(groups=groups, titles=titles, config_dict=config_dict, plots=pngs)
    report = out_dir / f"routing-{stamp}.md"
    report.write_text(text)
    chat = next((g for g in groups if KVPILOT in g.results), None)
    data = {
        "workloads": {
            g.name: {
                "summary": g.summary.to_json(),
                "calibration": g.calibration.to_json(),
                "oracle": {"hit_rate": g.oracle},
                "policies": list(g.results),
            }
            for g in groups
        },
        "policies": {key: r.to_json() for key, r in results.items()},
        "targets": [
            {"target": what, "met": met, "measured": measured}
            for what, met, measured in (targets(chat.results, chat.oracle) if chat else [])
        ],
        "config": config_dict,
        "plots": pngs,
    }
    (out_dir / f"routing-{stamp}.json").write_text(json.dumps(data, indent=2, default=str))
    requests = {key: [q.to_json() for q in r.per_request] for key, r in summaries.items()}
    (out_dir / f"routing-{stamp}-requests.json").write_text(json.dumps(requests))
    return report


@dataclass(frozen=True)
class RoutingRun:
    """A finished run read back from its JSON file: what its report is rendered from."""

    groups: list[WorkloadGroup]
    config_dict: dict[str, Any]
    plots: list[str]


def load(report_json: Path) -> RoutingRun:
    """A run from its JSON file (every number the report shows; not the raw series the plots
    and the tail breakdown are made from: the breakdown comes from the file)."""
    data = json.loads(report_json.read_text())
    policies = data["policies"]
    groups = [
        WorkloadGroup(
            name=name,
            summary=WorkloadSummary.from_json(workload["summary"]),
            calibration=Calibration.from_json(workload["calibration"]),
            oracle=float(workload["oracle"]["hit_rate"]),
            results={key: PolicyResult.from_json(policies[key]) for key in workload["policies"]},
        )
        for name, workload in data["workloads"].items()
    ]
    return RoutingRun(groups, data["config"], list(data.get("plots", [])))
