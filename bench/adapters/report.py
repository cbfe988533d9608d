"""The adapters benchmark's Markdown report: both policies side by side, and the target."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from bench.adapters.config import AdaptersConfig
from bench.adapters.results import AdapterRun
from bench.rig.jsonfields import known
from replicasim.simulator import SimConfig

TARGET_RATIO = 0.5
"""Adapter-aware routing should load adapters at most half as often as blind routing."""


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def load(path: Path) -> tuple[AdaptersConfig, dict[str, AdapterRun]]:
    """A run's settings and results from its JSON file."""
    document = json.loads(path.read_text())
    settings = document["config"]
    config = AdaptersConfig(
        **known(AdaptersConfig, settings, "sim", "policies", "out_dir"),
        sim=SimConfig(**settings["sim"]) if "sim" in settings else SimConfig(),
        policies=tuple(settings.get("policies", AdaptersConfig.policies)),
        out_dir=Path(settings.get("out_dir", AdaptersConfig.out_dir)),
    )
    results = {key: AdapterRun.from_json(r) for key, r in document["results"].items()}
    return config, results


def markdown(config: AdaptersConfig, results: Mapping[str, AdapterRun]) -> str:
    """The report: every policy's run side by side."""
    lines = [
        "# Adapter-aware routing",
        "",
        f"{config.replicas} simulated replicas, {config.adapters} LoRA adapters with "
        f"Zipf({config.zipf:g}) popularity, at most {config.max_loaded} loaded per "
        f"replica, {config.load_time:g} s per load; {config.requests} streamed requests "
        f"at {config.rate:g}/s (Poisson), the same arrivals for each policy.",
        "",
        "| policy | TTFT p50 (s) | TTFT p99 (s) | adapter loads | loads per 1,000 requests "
        "| errors |",
        "|---|---|---|---|---|---|",
    ]
    for key, result in results.items():
        lines.append(
            f"| {key} | {_seconds(result.ttft_p50)} | {_seconds(result.ttft_p99)} "
            f"| {result.adapter_loads:.0f} | {result.loads_per_1000:.1f} "
            f"| {result.errors} |"
        )
    steady = {key: result.steady for key, result in results.items() if result.steady}
    if len(steady) == len(results):
        lines += [
            "",
            f"Steady state (requests sent after the first {config.warmup:g} s, loads since then):",
            "",
            "| policy | requests | TTFT p50 (s) | TTFT p99 (s) | adapter loads "
            "| loads per 1,000 requests |",
            "|---|---|---|---|---|---|",
        ]
        for key, part in steady.items():
            lines.append(
                f"| {key} | {part.requests} | {_seconds(part.ttft_p50)} "
                f"| {_seconds(part.ttft_p99)} | {part.loads:.0f} "
                f"| {part.loads_per_1000:.1f} |"
            )
    blind, aware = results.get("blind"), results.get("aware")
    if blind and aware and blind.loads_per_1000:
        ratio = aware.loads_per_1000 / blind.loads_per_1000
        verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
        lines += [
            "",
            f"Target (aware at most {TARGET_RATIO:.0%} of blind's loads): {verdict}, "
            f"aware loads {ratio:.1%} as often.",
        ]
    lines += ["", "Requests per replica:", ""]
    for key, result in results.items():
        served = ", ".join(f"{name} {count}" for name, count in result.served_by_replica.items())
        lines.append(f"- {key}: {served}")
    return "\n".join(lines) + "\n"
