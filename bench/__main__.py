"""``make bench`` / ``python -m bench [NAME] [flags]``: every benchmark in `bench.registry`.

``python -m bench`` alone runs the default benchmark (routing); ``python -m bench NAME --help``
lists one benchmark's flags. Each run prints where its report and JSON file are.
"""

from __future__ import annotations

import argparse
import sys

from bench.benchmark import Written
from bench.registry import BENCHMARKS, DEFAULT, by_name
from bench.rig.cli import UsageError, add_common


def parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per registered benchmark."""
    top = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"With no NAME, runs {DEFAULT}. How to add a benchmark: docs/benchmarks.md.",
    )
    sub = top.add_subparsers(dest="benchmark", metavar="NAME")
    for benchmark in BENCHMARKS:
        one = sub.add_parser(benchmark.name, help=benchmark.summary, description=benchmark.summary)
        add_common(one)
        benchmark.add_arguments(one)
    return top


def print_written(written: Written) -> None:
    """Where the run wrote its report and JSON file, one aligned line each."""
    paths = [(label, path) for label, path in (("report", written.report), ("json", written.json))]
    present = [(f"{label}:", path) for label, path in paths if path is not None]
    if not present:
        return
    width = max(len(label) for label, _ in present)
    print()
    for label, path in present:
        print(f"{label:<{width}} {path}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    benchmarks = by_name()
    if argv and not argv[0].startswith("-") and argv[0] not in benchmarks:
        print(f"unknown benchmark {argv[0]!r}; known: {', '.join(benchmarks)}")
        return 2
    if not argv or argv[0] not in (*benchmarks, "-h", "--help"):
        argv = [DEFAULT, *argv]
    args = parser().parse_args(argv)
    try:
        written = benchmarks[args.benchmark].run(args)
    except UsageError as error:
        print(error)
        return 2
    print_written(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
