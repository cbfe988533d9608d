"""``python -m bench rollout``: a bad canary, a progressive rollout against a blind split."""

from __future__ import annotations

import argparse

from bench.benchmark import Written
from bench.rig.cli import with_out


class RolloutBenchmark:
    """The rollout benchmark (`bench.benchmark.Benchmark`)."""

    name = "rollout"
    summary = "a bad canary: progressive rollout vs blind split"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """No flags beyond the shared ones."""

    def run(self, args: argparse.Namespace) -> Written:
        from bench.rollout.run import default_rollout_config, run_rollout_bench

        config = with_out(default_rollout_config(short=args.short), args)
        return Written(report=run_rollout_bench(config, state_dir=args.state_dir))


BENCHMARK = RolloutBenchmark()
