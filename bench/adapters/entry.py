"""``python -m bench adapters``: LoRA adapters, adapter-aware against adapter-blind routing."""

from __future__ import annotations

import argparse

from bench.benchmark import Written
from bench.rig.cli import with_out


class AdaptersBenchmark:
    """The adapters benchmark (`bench.benchmark.Benchmark`)."""

    name = "adapters"
    summary = "LoRA adapters: adapter-aware vs adapter-blind routing (TTFT, adapter loads)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """No flags beyond the shared ones."""

    def run(self, args: argparse.Namespace) -> Written:
        from bench.adapters.config import default_config
        from bench.adapters.run import run_adapters

        config = with_out(default_config(short=args.short), args)
        report = run_adapters(config, state_dir=args.state_dir)
        return Written(report=report, json=report.with_suffix(".json"))


BENCHMARK = AdaptersBenchmark()
