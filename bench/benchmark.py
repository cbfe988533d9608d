"""The protocol every benchmark implements, and what a run hands back."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Written:
    """What a benchmark run wrote, printed at its end (a script reads the paths there)."""

    report: Path | None = None
    """The Markdown report, if the benchmark writes one."""
    json: Path | None = None
    """The JSON file of every number, if the benchmark writes one."""


class Benchmark(Protocol):
    """One benchmark: ``python -m bench NAME [flags]``.

    The shared flags (``--short``, ``--out``, ``--state-dir``) are added for every benchmark
    (`bench.rig.cli.add_common`); `add_arguments` adds its own. `run` turns the parsed flags
    into its config (flags that make no run raise `bench.rig.cli.UsageError`),
    runs it and writes its report. Heavy imports belong inside `run`, so ``--help`` stays
    quick.
    """

    @property
    def name(self) -> str:
        """The command-line name (``python -m bench NAME``)."""
        ...

    @property
    def summary(self) -> str:
        """One line for ``python -m bench --help``."""
        ...

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the benchmark's own flags."""
        ...

    def run(self, args: argparse.Namespace) -> Written:
        """Run the benchmark the flags describe; what it wrote."""
        ...
