"""`python -m bench.cost [--short] [--seeds 1,2,3] [--policies a,b] [--out DIR]`: the cost
benchmark, one run per seed, then the report over every seed."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.cost.config import default_config
from bench.cost.report import markdown
from bench.cost.run import run_cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cost")
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--policies", default="")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--state-dir", type=Path, default=None, help="keep logs here")
    parser.add_argument(
        "--overflow", default="{}", help="JSON fields added to cost-aware's overflow (tuning)"
    )
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    results: dict[int, Any] = {}
    config = default_config(short=args.short)
    for seed in seeds:
        config = default_config(short=args.short, seed=seed)
        if args.out is not None:
            config = replace(config, out_dir=args.out)
        extra = json.loads(args.overflow)
        if extra:
            config = replace(config, overflow=extra)
        if args.policies:
            config = replace(config, policies=tuple(args.policies.split(",")))
        state = None if args.state_dir is None else args.state_dir / f"seed{seed}"
        report = run_cost(config, state)
        results[seed] = json.loads(report.with_suffix(".json").read_text())["results"]
    out = Path(config.out_dir)
    summary = out / f"cost-{time.strftime('%Y%m%d-%H%M%S')}.md"
    summary.write_text(markdown(results, config))
    print(summary.read_text())
    print(f"report: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
