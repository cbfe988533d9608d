"""``python -m bench routing``: which routing policy wins.

By default the scenario suite (`bench.routing.suite`): every policy side by side, at the same
time, each on its own simulated fleet behind one real Envoy, in the scenarios where live
telemetry has to pay off, over several seeds. With ``--sequential``, one workload replayed
policy after policy through one fleet (`bench.routing.sequential`), with every request's
measurements and PNG plots: the closer look at one workload.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from bench.benchmark import Written
from bench.rig.cli import UsageError, names, with_out

_SUITE_ONLY = ("seeds", "scenarios", "time_scale", "batch_sizes")
_SEQUENTIAL_ONLY = ("workload", "arrival", "no_plots")


class RoutingBenchmark:
    """The routing benchmark (`bench.benchmark.Benchmark`)."""

    name = "routing"
    summary = (
        "which routing policy wins: every policy side by side per scenario (default), or "
        "--sequential: one workload, policy after policy, with plots"
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--policies", default="", help="comma list of policies to run")
        parser.add_argument(
            "--sequential",
            action="store_true",
            help="replay one workload policy after policy (per-request files and plots)",
        )
        suite = parser.add_argument_group("the scenario suite (default)")
        suite.add_argument("--seeds", default="", help="comma list of seeds (1,2,3)")
        suite.add_argument("--scenarios", default="", help="comma list of scenarios")
        suite.add_argument(
            "--batch-sizes",
            default="",
            help="comma list of the replicas' batch sizes (8,32,128), each a run of its own fleets",
        )
        suite.add_argument(
            "--time-scale",
            type=float,
            default=None,
            help="wall seconds per simulated second at batch size 8 (0.5; larger batches "
            "scale it by the square root of their growth); more gives a busy machine's load "
            "generators slack, at that much more wall time",
        )
        sequential = parser.add_argument_group("with --sequential")
        sequential.add_argument("--workload", choices=["multiturn", "docs", "mix"], default=None)
        sequential.add_argument("--arrival", choices=["poisson", "bursty"], default=None)
        sequential.add_argument("--no-plots", action="store_true")

    def run(self, args: argparse.Namespace) -> Written:
        wrong = _SUITE_ONLY if args.sequential else _SEQUENTIAL_ONLY
        given = [f"--{flag.replace('_', '-')}" for flag in wrong if getattr(args, flag)]
        if given:
            mode = "--sequential" if args.sequential else "the scenario suite"
            raise UsageError(f"{', '.join(given)} does not apply to {mode}")
        report = _sequential(args) if args.sequential else _suite(args)
        return Written(report=report, json=report.with_suffix(".json"))


def _suite(args: argparse.Namespace) -> Path:
    from bench.routing.scenarios import SCENARIOS, SUITE_POLICIES, default_suite
    from bench.routing.suite import run_suite

    config = with_out(default_suite(short=args.short), args)
    if args.seeds:
        config = replace(config, seeds=tuple(int(s) for s in args.seeds.split(",") if s.strip()))
    if args.scenarios:
        known = {s.key: s for s in SCENARIOS}
        known.update({s.key: s for s in default_suite().scenarios})
        wanted = names(args.scenarios, known, "scenarios")
        short = {s.key: s for s in config.scenarios}
        config = replace(config, scenarios=tuple(short.get(k, known[k]) for k in wanted))
    if args.policies:
        keys = (p.key for p in SUITE_POLICIES)
        config = replace(config, policies=names(args.policies, keys, "policies"))
    if args.batch_sizes:
        sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
        if not sizes or min(sizes) < 1:
            raise UsageError(f"--batch-sizes: positive integers, not {args.batch_sizes!r}")
        config = replace(config, batch_sizes=sizes)
    if args.time_scale:
        config = replace(config, sim=replace(config.sim, time_scale=args.time_scale))
    return run_suite(config, state_dir=args.state_dir)


def _sequential(args: argparse.Namespace) -> Path:
    from bench.routing.sequential import POLICIES, default_config, run_routing

    config = with_out(default_config(short=args.short), args)
    if args.policies:
        config = replace(
            config, policies=names(args.policies, (p.key for p in POLICIES), "policies")
        )
    if args.workload:
        config = replace(config, workload=replace(config.workload, kind=args.workload))
    if args.arrival:
        config = replace(
            config,
            workload=replace(config.workload, arrival=args.arrival),
            docs_workload=replace(config.docs_workload, arrival=args.arrival),
        )
    if args.no_plots:
        config = replace(config, plots=False)
    return run_routing(config, state_dir=args.state_dir)


BENCHMARK = RoutingBenchmark()
