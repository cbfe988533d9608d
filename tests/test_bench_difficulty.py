"""The difficulty benchmark runs end to end on a small draw and its report says what it must."""

from __future__ import annotations

from pathlib import Path

from bench.difficulty.__main__ import main


def test_the_short_difficulty_benchmark_writes_its_report_and_curve(tmp_path: Path) -> None:
    assert main(["--short", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "difficulty.md").read_text()
    assert "At a 20% large-model share" in report
    assert "| oracle | 20 |" in report
    assert "depends on the scorer and on its labels" in report
    assert (tmp_path / "difficulty-curve.png").stat().st_size > 0
