"""The adapters benchmark's Markdown report: both policies side by side, and the target."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TARGET_RATIO = 0.5
"""Adapter-aware routing should load adapters at most half as often as blind routing."""


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(document: Mapping[str, Any]) -> str:
    """The report for ``{"config": ..., "results": {policy: summary}}``."""
    config, results = document["config"], document["results"]
    lines = [
        "# Adapter-aware routing",
        "",
        f"{config['replicas']} simulated replicas, {config['adapters']} LoRA adapters with "
        f"Zipf({config['zipf']:g}) popularity, at most {config['max_loaded']} loaded per "
        f"replica, {config['load_time']:g} s per load; {config['requests']} streamed requests "
        f"at {config['rate']:g}/s (Poisson), the same arrivals for each policy.",
        "",
        "| policy | TTFT p50 (s) | TTFT p99 (s) | adapter loads | loads per 1,000 requests "
        "| errors |",
        "|---|---|---|---|---|---|",
    ]
    for key, result in results.items():
        lines.append(
            f"| {key} | {_seconds(result['ttftP50'])} | {_seconds(result['ttftP99'])} "
            f"| {result['adapterLoads']:.0f} | {result['loadsPer1000']:.1f} "
            f"| {result['errors']} |"
        )
    if all("steadyTtftP99" in result for result in results.values()):
        lines += [
            "",
            f"Steady state (requests sent after the first {config.get('warmup', 0):g} s, "
            "loads since then):",
            "",
            "| policy | requests | TTFT p50 (s) | TTFT p99 (s) | adapter loads "
            "| loads per 1,000 requests |",
            "|---|---|---|---|---|---|",
        ]
        for key, result in results.items():
            lines.append(
                f"| {key} | {result['steadyRequests']} | {_seconds(result['steadyTtftP50'])} "
                f"| {_seconds(result['steadyTtftP99'])} | {result['steadyLoads']:.0f} "
                f"| {result['steadyLoadsPer1000']:.1f} |"
            )
    blind, aware = results.get("blind"), results.get("aware")
    if blind and aware and blind["loadsPer1000"]:
        ratio = aware["loadsPer1000"] / blind["loadsPer1000"]
        verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
        lines += [
            "",
            f"Target (aware at most {TARGET_RATIO:.0%} of blind's loads): {verdict}, "
            f"aware loads {ratio:.1%} as often.",
        ]
    lines += ["", "Requests per replica:", ""]
    for key, result in results.items():
        served = ", ".join(f"{name} {count}" for name, count in result["servedByReplica"].items())
        lines.append(f"- {key}: {served}")
    return "\n".join(lines) + "\n"
