"""``python -m bench difficulty``: model selection by difficulty, quality against cost."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.benchmark import Written


class DifficultyBenchmark:
    """The difficulty benchmark (`bench.benchmark.Benchmark`)."""

    name = "difficulty"
    summary = "virtual models: scorers against random and oracle, the quality-cost curve"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """No flags beyond the shared ones."""

    def run(self, args: argparse.Namespace) -> Written:
        from bench.difficulty.__main__ import run_and_report

        out = args.out if args.out is not None else Path("bench/results")
        report = run_and_report(out, short=args.short)
        return Written(report=report, json=report.with_suffix(".json"))


BENCHMARK = DifficultyBenchmark()
