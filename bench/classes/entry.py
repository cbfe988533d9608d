"""``python -m bench classes``: interactive chat while batch work overloads the fleet."""

from __future__ import annotations

import argparse
from dataclasses import replace

from bench.benchmark import Written
from bench.rig.cli import names, with_out


class ClassesBenchmark:
    """The service-class benchmark (`bench.benchmark.Benchmark`)."""

    name = "classes"
    summary = "service classes: interactive chat while batch overloads the fleet"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--policies", default="", help="comma list of policies to run")

    def run(self, args: argparse.Namespace) -> Written:
        from bench.classes.config import POLICIES, default_config
        from bench.classes.run import run_classes

        config = with_out(default_config(short=args.short), args)
        if args.policies:
            keys = (p.key for p in POLICIES)
            config = replace(config, policies=names(args.policies, keys, "policies"))
        report = run_classes(config, state_dir=args.state_dir)
        return Written(report=report, json=report.with_suffix(".json"))


BENCHMARK = ClassesBenchmark()
