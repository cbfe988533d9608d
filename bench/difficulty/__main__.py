"""``python -m bench difficulty [--short] [--out DIR]`` (or ``python -m bench.difficulty``): run
the difficulty benchmark and write ``difficulty.md``, ``difficulty.json`` and
``difficulty-curve.png`` under DIR."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench.difficulty.prompts import PromptMix
from bench.difficulty.report import markdown, plot, recovery
from bench.difficulty.run import DifficultyConfig, run_difficulty

NOISE_SWEEP = (0.0, 0.1, 0.15, 0.2, 0.3)


def run_and_report(out: Path, *, short: bool = False) -> Path:
    """Run the benchmark, write its files under ``out``; the report's path."""
    config = DifficultyConfig()
    if short:
        config = replace(config, prompts=1000, training=600, shares=(10, 20, 40))
    result = run_difficulty(config)
    sweep = {}
    for noise in NOISE_SWEEP:
        noisy = replace(config, mix=replace(PromptMix(), noise=noise), shares=(20,))
        outcomes = run_difficulty(noisy)["outcomes"]
        sweep[noise] = {
            name: recovery(outcomes, name, 20.0)  # type: ignore[arg-type]
            for name in ("builtin", "fitted")
        }
    out.mkdir(parents=True, exist_ok=True)
    png = out / "difficulty-curve.png"
    plot(result["outcomes"], png)  # type: ignore[arg-type]
    (out / "difficulty.json").write_text(json.dumps({**result, "sweep": sweep}, indent=1))
    report = out / "difficulty.md"
    report.write_text(markdown(result, sweep, png.name))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.difficulty")
    parser.add_argument("--short", action="store_true", help="fewer prompts and shares")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    print(run_and_report(args.out, short=args.short))
    return 0


if __name__ == "__main__":
    sys.exit(main())
