"""``python -m bench.regions [--short] [--out DIR] [--state-dir DIR] [--policies blind,aware]``"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.regions.config import POLICIES, default_regions_config
from bench.regions.run import run_regions_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.regions", description=__doc__)
    parser.add_argument("--short", action="store_true", help="a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="output directory (bench/results)")
    parser.add_argument("--state-dir", type=Path, default=None, help="keep logs here")
    parser.add_argument("--policies", default="", help=f"comma list of {', '.join(POLICIES)}")
    args = parser.parse_args(argv)
    config = default_regions_config(short=args.short)
    if args.out is not None:
        config = replace(config, out_dir=args.out)
    if args.policies:
        wanted = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        unknown = sorted(set(wanted) - set(POLICIES))
        if unknown:
            parser.error(f"unknown policies {unknown}; known: {list(POLICIES)}")
        config = replace(config, policies=wanted)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="kvpilot-regions-"))
    report = run_regions_bench(config, state_dir=state_dir)
    print(f"\nreport: {report}\njson:   {report.with_suffix('.json')}\nlogs:   {state_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
