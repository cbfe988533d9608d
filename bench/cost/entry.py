"""``python -m bench cost``: owned replicas and a paid API under a load that rises to 150% of
the owned capacity, four policies side by side, over several seeds."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from bench.benchmark import Written
from bench.rig.cli import UsageError, names


class CostBenchmark:
    """The cost-aware overflow benchmark (`bench.benchmark.Benchmark`)."""

    name = "cost"
    summary = "cost-aware overflow: owned replicas and a paid API under a peak of 150%% of capacity"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--seeds", default="1,2,3", help="comma list of seeds (1,2,3)")
        parser.add_argument("--policies", default="", help="comma list of policies to run")
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            help="sequences the owned replicas batch (the suite's first batch size, 8, by default)",
        )
        parser.add_argument(
            "--overflow",
            default="{}",
            help="JSON fields added to cost-aware's overflow, for tuning runs",
        )

    def run(self, args: argparse.Namespace) -> Written:
        from bench.cost.config import POLICIES, default_config
        from bench.cost.report import markdown
        from bench.cost.results import CostSummary
        from bench.cost.run import run_cost
        from bench.routing.scenarios import SUITE_MAX_BATCH

        try:
            seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
            extra = json.loads(args.overflow)
        except ValueError as error:
            raise UsageError(
                f"--seeds is a comma list of integers, --overflow JSON: {error}"
            ) from None
        if not seeds or not isinstance(extra, dict):
            raise UsageError("--seeds needs a seed; --overflow is a JSON object")
        batch = SUITE_MAX_BATCH if args.batch_size is None else args.batch_size
        if batch < 1:
            raise UsageError(f"--batch-size is a number of sequences, at least 1: {batch}")
        policies = names(args.policies, (p.key for p in POLICIES), "policies")
        results: dict[int, dict[str, CostSummary]] = {}
        config = default_config(short=args.short, batch=batch)
        for seed in seeds:
            config = replace(
                default_config(short=args.short, seed=seed, batch=batch), overflow=extra
            )
            if args.out is not None:
                config = replace(config, out_dir=args.out)
            if policies:
                config = replace(config, policies=policies)
            state = None if args.state_dir is None else Path(args.state_dir) / f"seed{seed}"
            report = run_cost(config, state)
            data = json.loads(report.with_suffix(".json").read_text())["results"]
            results[seed] = {key: CostSummary.from_json(entry) for key, entry in data.items()}
        out = Path(config.out_dir)
        summary = out / f"cost-{time.strftime('%Y%m%d-%H%M%S')}.md"
        summary.write_text(markdown(results, config))
        data = {
            seed: {key: entry.to_json() for key, entry in by_policy.items()}
            for seed, by_policy in results.items()
        }
        summary.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
        print(summary.read_text())
        return Written(report=summary, json=summary.with_suffix(".json"))


BENCHMARK = CostBenchmark()
