"""The order `make test` hands modules to its workers in (`harness.order`)."""

from __future__ import annotations

from pathlib import Path

from harness.order import LONGEST_MODULES


def test_every_module_ranked_longest_exists_once() -> None:
    """A module renamed or removed would lose its place silently and run last again."""
    here = Path(__file__).parent
    assert [name for name in LONGEST_MODULES if not (here / name).is_file()] == []
    assert len(set(LONGEST_MODULES)) == len(LONGEST_MODULES)
