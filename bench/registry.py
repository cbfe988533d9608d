"""Every benchmark behind ``python -m bench``.

A benchmark is a subpackage of `bench` (its config, its run, its report) plus one object that
satisfies `bench.benchmark.Benchmark`; listing that object in `BENCHMARKS` is all
``python -m bench`` needs to offer it (its name, its one-line summary in ``--help``, its flags,
its run).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.adapters.entry import BENCHMARK as ADAPTERS
from bench.benchmark import Benchmark
from bench.classes.entry import BENCHMARK as CLASSES
from bench.controlplane.entry import BENCHMARK as CONTROLPLANE
from bench.cost.entry import BENCHMARK as COST
from bench.difficulty.entry import BENCHMARK as DIFFICULTY
from bench.regions.entry import BENCHMARK as REGIONS
from bench.rollout.entry import BENCHMARK as ROLLOUT
from bench.routing.entry import BENCHMARK as ROUTING

BENCHMARKS: Sequence[Benchmark] = (
    ROUTING,
    CONTROLPLANE,
    ROLLOUT,
    CLASSES,
    DIFFICULTY,
    ADAPTERS,
    REGIONS,
    COST,
)
"""Every benchmark, in the order ``--help`` lists them. `make bench` runs the first
(`DEFAULT`), then ``rollout``, then ``classes``, then ``regions``, then ``cost``."""

DEFAULT = ROUTING.name
"""What ``python -m bench`` runs when no benchmark is named."""


def by_name() -> dict[str, Benchmark]:
    """The benchmarks by command-line name (a name twice is a mistake in `BENCHMARKS`)."""
    table: dict[str, Benchmark] = {}
    for benchmark in BENCHMARKS:
        if benchmark.name in table:
            raise ValueError(f"two benchmarks are called {benchmark.name!r}")
        table[benchmark.name] = benchmark
    return table
