"""The regions benchmark's report, rendered from a committed run's file against the committed
Markdown, and its typed results read back from the file as they were written."""

from __future__ import annotations

import json

from harness.golden import BENCH, check, updating

from bench.regions.config import default_regions_config
from bench.regions.report import load, markdown
from bench.regions.results import Overload, RegionsRun


def test_the_report_rendered_from_a_runs_file_is_the_committed_markdown() -> None:
    """A real ``--short`` run of both policies: every row, and the JSON block."""
    runs = load(BENCH / "regions-short.json")
    text = markdown(default_regions_config(short=True), runs)
    check({"regions-short.md": text}, BENCH, update=updating())


def test_the_file_read_back_is_the_file_written_key_for_key() -> None:
    """``overload`` keeps its fleets beside ``expected_cross``, and every number its place."""
    data = json.loads((BENCH / "regions-short.json").read_text())
    runs = load(BENCH / "regions-short.json")
    assert json.dumps({p: r.to_json() for p, r in runs.items()}) == json.dumps(data)
    overload = runs["aware"].overload
    assert isinstance(overload, Overload) and set(overload.fleets) == set(
        default_regions_config().regions
    )
    assert RegionsRun.from_json(runs["aware"].to_json()) == runs["aware"]
