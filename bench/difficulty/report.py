"""The difficulty benchmark's report: medians over seeds per policy and share, the share of
the random-to-oracle quality gap each scorer recovers, a noise sweep, and the quality-cost
curve as a PNG."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

POLICY_ORDER = ("all_small", "random", "builtin", "fitted", "oracle", "all_large")


def _groups(
    outcomes: Sequence[Mapping[str, Any]],
) -> dict[tuple[str, float], list[Mapping[str, Any]]]:
    groups: dict[tuple[str, float], list[Mapping[str, Any]]] = defaultdict(list)
    for outcome in outcomes:
        groups[(outcome["policy"], float(outcome["target"]))].append(outcome)
    return groups


def recovery(outcomes: Sequence[Mapping[str, Any]], policy: str, share: float) -> list[float]:
    """Per seed: (policy - random) / (oracle - random) quality at ``share``."""
    groups = _groups(outcomes)
    by_seed = {
        name: {o["seed"]: o["quality"] for o in groups[(name, share)]}
        for name in ("random", "oracle", policy)
    }
    out = []
    for seed, mine in sorted(by_seed[policy].items()):
        gap = by_seed["oracle"][seed] - by_seed["random"][seed]
        out.append((mine - by_seed["random"][seed]) / gap if gap else 0.0)
    return out


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(outcomes: Sequence[Mapping[str, Any]]) -> str:
    """Median over seeds of each policy at each target share."""
    groups = _groups(outcomes)
    lines = [
        "| policy | target share % | large share % | good answers % | cost $ | TTFT mean ms "
        "| TTFT p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted(groups, key=lambda k: (POLICY_ORDER.index(k[0]), k[1]))
    for policy, target in keys:
        rows = groups[(policy, target)]
        lines.append(
            f"| {policy} | {target:g} | {_median([r['large_share'] for r in rows]):.1f} "
            f"| {_median([r['quality'] for r in rows]):.2f} "
            f"| {_median([r['cost'] for r in rows]):.3f} "
            f"| {1000 * _median([r['ttft_mean'] for r in rows]):.0f} "
            f"| {1000 * _median([r['ttft_p99'] for r in rows]):.0f} |"
        )
    return "\n".join(lines)


def plot(outcomes: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Quality against cost, one line per policy across target shares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(outcomes)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ends = [
        (
            _median([r["cost"] for r in groups[(name, share)]]),
            _median([r["quality"] for r in groups[(name, share)]]),
        )
        for name, share in (("all_small", 0.0), ("all_large", 100.0))
    ]
    for policy in ("random", "builtin", "fitted", "oracle"):
        shares = sorted(share for name, share in groups if name == policy)
        points = [
            (
                _median([r["cost"] for r in groups[(policy, share)]]),
                _median([r["quality"] for r in groups[(policy, share)]]),
            )
            for share in shares
        ]
        points = [ends[0], *points, ends[1]]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
    ax.set_xlabel("cost of the run ($, modelled prices)")
    ax.set_ylabel("good answers (%)")
    ax.set_title("Quality against cost over target shares of the large model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(
    result: Mapping[str, Any], sweep: Mapping[float, Mapping[str, list[float]]], png: str
) -> str:
    """The whole report."""
    outcomes = result["outcomes"]
    config = result["config"]
    fits = result["fits"]
    builtin = recovery(outcomes, "builtin", 20.0)
    fitted = recovery(outcomes, "fitted", 20.0)
    mix = config["mix"]
    models = config["models"]
    rows = int(next(iter(fits.values()))["fitted_training_rows"])
    aucs = ", ".join(f"{fit['fitted_auc']:.3f}" for fit in fits.values())
    lines = [
        "# Difficulty benchmark",
        "",
        f"Seeds {', '.join(map(str, config['seeds']))}; {config['prompts']} prompts per seed, "
        f"{mix['hard_share'] * 100:g}% hard; feature noise {mix['noise']:g}; the small model "
        f"fails {mix['small_fails_hard'] * 100:g}% of hard and {mix['small_fails_easy'] * 100:g}% "
        "of easy prompts, the large one none. Scored policies run through the share loop "
        "(controller, 2 s lag, per-worker cap and floor at the target +-10 points).",
        "",
        f"Prices: small ${models['small_price']}/M tokens, large ${models['large_price']}/M; "
        f"TTFT model: small {models['small_ttft_base'] * 1000:g} ms + "
        f"{models['small_ttft_per_token'] * 1e6:g} us/prompt token, large "
        f"{models['large_ttft_base'] * 1000:g} ms + {models['large_ttft_per_token'] * 1e6:g} "
        "us/prompt token. Both are models, stated here, not measurements.",
        "",
        "## At a 20% large-model share",
        "",
        "Share of the quality gap between random routing and the oracle that each scorer "
        "recovers (per seed, then the median):",
        "",
        f"- built-in weights: {', '.join(f'{v:.1%}' for v in builtin)}; median "
        f"**{_median(builtin):.1%}**",
        f"- fitted weights (`kvpilot difficulty fit` on {rows} labelled rows of a separate "
        f"draw; held-out ROC AUC {aucs}): "
        f"{', '.join(f'{v:.1%}' for v in fitted)}; median **{_median(fitted):.1%}**",
        "",
        "## Every policy and share (median over seeds)",
        "",
        table(outcomes),
        "",
        f"![quality against cost]({png})",
        "",
        "## Feature noise sweep (20% share, median recovery over seeds)",
        "",
        "| noise | built-in | fitted |",
        "|---:|---:|---:|",
        *(
            f"| {noise:g} | {_median(values['builtin']):.1%} | {_median(values['fitted']):.1%} |"
            for noise, values in sorted(sweep.items())
        ),
        "",
        "Quality on real traffic depends on the scorer and on its labels: these prompts are "
        "drawn so that their features say something about their difficulty, and how much is "
        "the noise setting above.",
        "",
    ]
    return "\n".join(lines)
