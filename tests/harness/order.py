"""The order `make test` hands the test modules to its workers in."""

from __future__ import annotations

import pytest

LONGEST_MODULES = (
    "test_e2e_telemetry.py",
    "test_e2e_rollouts.py",
    "test_e2e_budgets.py",
    "test_e2e_routing.py",
    "test_e2e_regions.py",
    "test_e2e_no_push.py",
    "test_e2e_difficulty.py",
    "test_console.py",
    "test_e2e_overflow_arrivals.py",
    "test_quickstart.py",
    "test_bench_smoke.py",
    "test_e2e_difficulty_scorer.py",
    "test_e2e_ads.py",
    "test_launchers.py",
    "test_e2e_failover.py",
    "test_e2e_etcd_cluster.py",
    "test_e2e_overflow.py",
    "test_e2e_rollout_fleets.py",
    "test_e2e_spend.py",
    "test_api_fuzz.py",
    "test_console_actions.py",
)
"""The modules that take longest, longest first (`pytest --durations=0` summed by module, three
workers on 2 cores: 117 s down to 28 s). `make test` hands whole modules to its workers in
collection order (`--no-loadscope-reorder`; xdist's own order, most tests first, put these
last): one handed out last keeps a worker busy for a minute or two after the others ran out."""


def longest_first(items: list[pytest.Item]) -> None:
    """Sort `items`: the longest modules first (``LONGEST_MODULES``), then the other
    end-to-end ones, then the rest, each group in its usual order."""
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}

    def key(item: pytest.Item) -> tuple[int, int]:
        return rank.get(item.path.name, len(rank)), item.get_closest_marker("e2e") is None

    items.sort(key=key)
