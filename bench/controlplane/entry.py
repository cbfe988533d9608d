"""``python -m bench controlplane``: change-to-ACK latency, scale and memory of kvpilot's ADS,
and with ``--baseline REF`` the same measured against an older commit in the same run."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from bench.benchmark import Written
from bench.rig.cli import with_out


class ControlPlaneBenchmark:
    """The control-plane benchmark (`bench.benchmark.Benchmark`)."""

    name = "controlplane"
    summary = "ADS: change-to-ACK latency, scale, memory"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--baseline",
            default="",
            help="git ref to compare rebuild times with, side by side in this run (e.g. main)",
        )
        parser.add_argument("--rounds", type=int, default=3, help="baseline rounds (3)")
        parser.add_argument(
            "--only",
            choices=["all", "scale", "acks"],
            default="all",
            help="with --baseline: scale (rebuilds in process) or acks (an endpoint change to "
            "real Envoys) alone",
        )

    def run(self, args: argparse.Namespace) -> Written:
        from bench.controlplane.results import default_config
        from bench.controlplane.run import run_controlplane

        config = with_out(default_config(short=args.short), args)
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
                side_by_side = translation_side_by_side(
                    args.baseline, config.endpoints, args.rounds
                )
                (out_dir / "controlplane-scale.json").write_text(
                    json.dumps(asdict(side_by_side), indent=2)
                )
                print(markdown(side_by_side))
            if args.only in ("all", "acks"):
                acks = ack_side_by_side(
                    args.baseline, config.endpoints, config.big_envoys, config.changes
                )
                (out_dir / "controlplane-acks.json").write_text(json.dumps(asdict(acks), indent=2))
                print(acks_markdown(acks))
        if args.only != "all":
            return Written()
        return Written(json=run_controlplane(config, state_dir=args.state_dir))


BENCHMARK = ControlPlaneBenchmark()
