"""`make bench` / `python -m bench`: kvpilot's benchmarks behind one entry point.

    python -m bench [routing] [--short] [--out DIR] [--policies a,b] [--state-dir DIR]
    python -m bench controlplane [--short] [--out DIR] [--state-dir DIR]
        [--baseline REF [--rounds N] [--only scale]]

`routing` (the default) replays LLM workloads (multi-turn chat, shared documents) through a
real Envoy configured by kvpilot under several routing policies and writes a Markdown report,
a JSON file, every request's measurements and PNG plots under ``bench/results/``; it prints
the report's path. Policies: round_robin, least_request, affinity, affinity_telemetry, orca,
docs_round_robin, docs_prefix; and on request affinity_125 and affinity_200, bounded-load
sensitivity checks.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench.routing import POLICIES, default_config, run_routing


def _routing(args: argparse.Namespace) -> int:
    config = default_config(short=args.short)
    if args.out is not None:
        config = replace(config, out_dir=args.out)
    if args.policies:
        wanted = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        unknown = sorted(set(wanted) - {p.key for p in POLICIES})
        if unknown:
            print(f"unknown policies {unknown}; known: {[p.key for p in POLICIES]}")
            return 2
        config = replace(config, policies=wanted)
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
    report = run_routing(config, state_dir=args.state_dir)
    print(f"\nreport: {report}")
    print(f"json:   {report.with_suffix('.json')}")
    return 0


def _controlplane(args: argparse.Namespace) -> int:
    from bench.controlplane import default_config as controlplane_config
    from bench.controlplane import run_controlplane

    config = controlplane_config(short=args.short)
    if args.out is not None:
        config = replace(config, out_dir=args.out)
    if args.baseline:
        from bench.scale import markdown, translation_side_by_side

        side_by_side = translation_side_by_side(args.baseline, config.endpoints, args.rounds)
        out_dir = config.out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "controlplane-scale.json").write_text(json.dumps(side_by_side, indent=2))
        print(markdown(side_by_side))
    if args.only != "scale":
        print(f"\njson: {run_controlplane(config, state_dir=args.state_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")
    routing = sub.add_parser("routing", help="routing policies through Envoy (default)")
    for p in (parser, routing):
        p.add_argument("--short", action="store_true", help="a smoke run of under a minute")
        p.add_argument("--out", type=Path, default=None, help="output directory (bench/results)")
        p.add_argument("--policies", default="", help="comma list of policies to run")
        p.add_argument("--workload", choices=["multiturn", "docs", "mix"], default=None)
        p.add_argument("--arrival", choices=["poisson", "bursty"], default=None)
        p.add_argument("--no-plots", action="store_true")
        p.add_argument("--state-dir", type=Path, default=None, help="keep logs here")
    controlplane = sub.add_parser("controlplane", help="ADS: change-to-ACK latency, scale, memory")
    controlplane.add_argument("--short", action="store_true", help="a smoke run (seconds)")
    controlplane.add_argument("--out", type=Path, default=None, help="output directory")
    controlplane.add_argument("--state-dir", type=Path, default=None, help="keep logs here")
    controlplane.add_argument(
        "--baseline",
        default="",
        help="git ref to compare rebuild times with, side by side in this run (e.g. main)",
    )
    controlplane.add_argument("--rounds", type=int, default=3, help="baseline rounds (3)")
    controlplane.add_argument(
        "--only", choices=["all", "scale"], default="all", help="scale: the comparison alone"
    )
    args = parser.parse_args(argv)
    if args.command == "controlplane":
        return _controlplane(args)
    return _routing(args)


if __name__ == "__main__":
    sys.exit(main())
