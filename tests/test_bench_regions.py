"""The regions benchmark's report, rendered from a committed run's file against the committed
Markdown, and its typed results read back from the file as they were written."""

from __future__ import annotations

import json
import random
from pathlib import Path

from harness.golden import BENCH, check, updating

from bench.regions.config import default_regions_config
from bench.regions.floor import floor, queue_waits
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


def test_a_queue_of_slots_waits_only_near_its_capacity() -> None:
    calm = queue_waits(0.3, 32, 7.5, arrivals=4000)
    full = queue_waits(0.95, 32, 7.5, arrivals=4000)
    assert max(calm) == 0.0
    assert sum(w > 0 for w in full) / len(full) > 0.3


def test_the_floor_of_a_wave_that_must_cross_or_queue(tmp_path: Path) -> None:
    """Fleet A at 95% of the 32 slots it has left, every TTFT at once 110 ms against a p99 of
    120 ms before: a crossing request (190 ms) passes 1.5x (180 ms), and so does one that
    waits at all; the floor is over 1%. With a p99 before of 200 ms, crossing is free."""
    rate = 0.95 * 32 / 7.5
    rng = random.Random(1)
    records: list[dict[str, object]] = []
    for fleet in ("us-east", "eu-west"):
        t = 20.0
        while (t := t + rng.expovariate(rate)) < 60.0:
            records.append({"fleet": fleet, "start": t, "replica": f"{fleet}-0", "ttft": 0.11})

    def write(before_p99: float) -> Path:
        run = tmp_path / str(before_p99)
        run.mkdir()
        report = {"service_s": 7.5, "wave": {"before": {"ttft_p99": before_p99}}}
        (run / "regions-1.json").write_text(json.dumps({"aware": report}))
        marks = {"phases": {"wave": [0.0, 60.0]}, "notice": 20.0, "gone": 50.0}
        (run / "regions-1.decisions.json").write_text(json.dumps({"aware": marks}))
        (run / "regions-1.requests.json").write_text(json.dumps({"aware": records}))
        return run

    tight = floor(write(0.12), arrivals=4000)
    assert tight.cross_over == 1.0 and tight.least_over > 0.01
    assert floor(write(0.2), arrivals=4000).least_over == 0.0
