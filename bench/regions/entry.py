"""``python -m bench regions``: locality-blind against locality-aware routing in two regions."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.benchmark import Written
from bench.rig.cli import names, with_out


class RegionsBenchmark:
    """The regions benchmark (`bench.benchmark.Benchmark`)."""

    name = "regions"
    summary = "two regions: locality-aware vs blind; overload, region down, spot wave"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--policies",
            default="",
            help="comma list of blind, fill, aware (the default: all three), gate",
        )
        parser.add_argument("--seed", type=int, default=1, help="the load's random seed")

    def run(self, args: argparse.Namespace) -> Written:
        from bench.regions.config import EXTRA_POLICIES, POLICIES, default_regions_config
        from bench.regions.run import run_regions_bench

        config = with_out(default_regions_config(short=args.short), args)
        if args.policies:
            config = replace(
                config, policies=names(args.policies, POLICIES + EXTRA_POLICIES, "policies")
            )
        config = replace(config, seed=args.seed)
        state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="kvpilot-regions-"))
        report = run_regions_bench(config, state_dir=state_dir)
        return Written(report=report, json=report.with_suffix(".json"))


BENCHMARK = RegionsBenchmark()
