"""`make bench` / `python -m bench`: kvpilot's benchmarks behind one entry point.

    python -m bench [scenarios] [--short] [--out DIR] [--seeds 1,2,3] [--scenarios a,b]
                    [--policies a,b] [--state-dir DIR]
    python -m bench routing [--short] [--out DIR] [--policies a,b] [--state-dir DIR]
    python -m bench controlplane [--short] [--out DIR] [--state-dir DIR]
        [--baseline REF [--rounds N] [--only scale|acks]]
    python -m bench classes [--short] [--out DIR] [--policies a,b] [--state-dir DIR]
    python -m bench rollout [--short] [--out DIR] [--state-dir DIR]

`scenarios` (the default) runs every routing policy side by side, at the same time, on its
own simulated fleet behind one real Envoy, in the scenarios where live telemetry has to pay
off (homogeneous chat, chat + Zipf-popular documents, overload, a heterogeneous fleet, a
replica slowed mid-run, bursty arrivals), over several seeds; it writes
``bench/results/scenarios-*.md`` with the median and spread of every number and the targets.

`routing` replays LLM workloads (multi-turn chat, shared documents) through a
real Envoy configured by kvpilot under several routing policies and writes a Markdown report,
a JSON file, every request's measurements and PNG plots under ``bench/results/``; it prints
the report's path. Policies: round_robin, least_request, affinity, affinity_telemetry, orca,
docs_round_robin, docs_prefix; and on request affinity_125 and affinity_200, bounded-load
sensitivity checks. `classes` overloads 8 replicas with batch work on top of interactive chat
and compares round robin, affinity alone and affinity with service classes (batch shed,
batch queued in Envoy, and batch shed on a lane of one replica of its own): round_robin,
affinity, classes, classes_queue, classes_lane, each after the reference (interactive
alone).

`rollout` replays multi-turn chat at 70% load against a bad canary twice: under a blind 90/10
split and under a kvpilot Rollout that watches the data plane. `make bench` runs the
scenarios, then `rollout`, then `classes`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from bench.routing.sequential import POLICIES, default_config, run_routing

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Config = TypeVar("_Config", bound="DataclassInstance")


class _UnknownNames(Exception):
    """A comma list named something the benchmark does not have."""


def _names(text: str, known: Iterable[str], what: str) -> tuple[str, ...]:
    """The names in the comma list `text`, each one of `known`."""
    wanted = tuple(name.strip() for name in text.split(",") if name.strip())
    known = list(known)
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise _UnknownNames(f"unknown {what} {unknown}; known: {known}")
    return wanted


def _with_out(config: _Config, args: argparse.Namespace) -> _Config:
    """`config` writing to ``--out`` when given."""
    return config if args.out is None else replace(config, out_dir=args.out)


def _print_report(report: Path) -> int:
    print(f"\nreport: {report}")
    print(f"json:   {report.with_suffix('.json')}")
    return 0


def _routing(args: argparse.Namespace) -> int:
    config = _with_out(default_config(short=args.short), args)
    if args.policies:
        config = replace(
            config, policies=_names(args.policies, (p.key for p in POLICIES), "policies")
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
    return _print_report(run_routing(config, state_dir=args.state_dir))


def _scenarios(args: argparse.Namespace) -> int:
    from bench.routing.scenarios import SUITE_POLICIES, default_suite
    from bench.routing.suite import run_suite

    config = _with_out(default_suite(short=args.short), args)
    if args.seeds:
        config = replace(config, seeds=tuple(int(s) for s in args.seeds.split(",") if s.strip()))
    if args.scenarios:
        known = {s.key: s for s in default_suite().scenarios}
        wanted = _names(args.scenarios, known, "scenarios")
        short = {s.key: s for s in config.scenarios}
        config = replace(config, scenarios=tuple(short.get(k, known[k]) for k in wanted))
    if args.policies:
        keys = (p.key for p in SUITE_POLICIES)
        config = replace(config, policies=_names(args.policies, keys, "policies"))
    if args.time_scale:
        config = replace(config, sim=replace(config.sim, time_scale=args.time_scale))
    return _print_report(run_suite(config, state_dir=args.state_dir))


def _controlplane(args: argparse.Namespace) -> int:
    from bench.controlplane.run import default_config as controlplane_config
    from bench.controlplane.run import run_controlplane

    config = _with_out(controlplane_config(short=args.short), args)
    if args.baseline:
        from bench.controlplane.baseline import (
            ack_side_by_side,
            acks_markdown,
            markdown,
            translation_side_by_side,
        )

        out_dir = config.out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.only in ("all", "scale"):
            side_by_side = translation_side_by_side(args.baseline, config.endpoints, args.rounds)
            (out_dir / "controlplane-scale.json").write_text(json.dumps(side_by_side, indent=2))
            print(markdown(side_by_side))
        if args.only in ("all", "acks"):
            acks = ack_side_by_side(
                args.baseline, config.endpoints, config.big_envoys, config.changes
            )
            (out_dir / "controlplane-acks.json").write_text(json.dumps(acks, indent=2))
            print(acks_markdown(acks))
    if args.only == "all":
        print(f"\njson: {run_controlplane(config, state_dir=args.state_dir)}")
    return 0


def _classes(args: argparse.Namespace) -> int:
    from bench.classes.config import POLICIES as CLASSES_POLICIES
    from bench.classes.config import default_config as classes_config
    from bench.classes.run import run_classes

    config = _with_out(classes_config(short=args.short), args)
    if args.policies:
        keys = (p.key for p in CLASSES_POLICIES)
        config = replace(config, policies=_names(args.policies, keys, "policies"))
    return _print_report(run_classes(config, state_dir=args.state_dir))


def _rollout(args: argparse.Namespace) -> int:
    from bench.rollout.run import default_rollout_config, run_rollout_bench

    config = _with_out(default_rollout_config(short=args.short), args)
    print(f"\nreport: {run_rollout_bench(config, state_dir=args.state_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")
    scenarios = sub.add_parser(
        "scenarios", help="every policy side by side, per scenario (default)"
    )
    routing = sub.add_parser("routing", help="one workload, policy after policy, with plots")
    controlplane = sub.add_parser("controlplane", help="ADS: change-to-ACK latency, scale, memory")
    classes = sub.add_parser(
        "classes", help="service classes: interactive chat while batch overloads the fleet"
    )
    rollout = sub.add_parser("rollout", help="a bad canary: progressive rollout vs blind split")
    for p in (parser, scenarios, routing, controlplane, classes, rollout):
        p.add_argument("--short", action="store_true", help="a smoke run")
        p.add_argument("--out", type=Path, default=None, help="output directory (bench/results)")
        p.add_argument("--state-dir", type=Path, default=None, help="keep logs here")
    for p in (parser, scenarios):
        p.add_argument("--seeds", default="", help="comma list of seeds (1,2,3)")
        p.add_argument("--scenarios", default="", help="comma list of scenarios")
        p.add_argument(
            "--time-scale",
            type=float,
            default=None,
            help="wall seconds per simulated second (0.5); more gives a busy machine's load "
            "generators slack, at that much more wall time",
        )
    for p in (parser, scenarios, routing, classes):
        p.add_argument("--policies", default="", help="comma list of policies to run")
    for p in (parser, routing):
        p.add_argument("--workload", choices=["multiturn", "docs", "mix"], default=None)
        p.add_argument("--arrival", choices=["poisson", "bursty"], default=None)
        p.add_argument("--no-plots", action="store_true")
    controlplane.add_argument(
        "--baseline",
        default="",
        help="git ref to compare rebuild times with, side by side in this run (e.g. main)",
    )
    controlplane.add_argument("--rounds", type=int, default=3, help="baseline rounds (3)")
    controlplane.add_argument(
        "--only",
        choices=["all", "scale", "acks"],
        default="all",
        help="with --baseline: scale (rebuilds in process) or acks (an endpoint change to real "
        "Envoys) alone",
    )
    args = parser.parse_args(argv)
    run = {
        "controlplane": _controlplane,
        "rollout": _rollout,
        "routing": _routing,
        "classes": _classes,
    }.get(args.command, _scenarios)
    try:
        return run(args)
    except _UnknownNames as error:
        print(error)
        return 2


if __name__ == "__main__":
    sys.exit(main())
