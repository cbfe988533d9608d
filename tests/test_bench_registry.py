"""`python -m bench` dispatches through the registry: every benchmark is listed, each has its
own flags, and flags that make no run are refused before anything starts."""

from __future__ import annotations

import pytest

from bench.__main__ import main, parser
from bench.registry import BENCHMARKS, DEFAULT, by_name


def test_help_lists_every_registered_benchmark_with_its_summary() -> None:
    text = parser().format_help()
    for benchmark in BENCHMARKS:
        assert benchmark.name in text
        assert benchmark.summary.split()[0] in text


def test_names_are_unique_and_the_default_is_registered() -> None:
    assert len(by_name()) == len(BENCHMARKS)
    assert DEFAULT in by_name()


def test_every_benchmark_takes_the_shared_flags() -> None:
    for benchmark in BENCHMARKS:
        args = parser().parse_args([benchmark.name, "--short", "--out", "x", "--state-dir", "y"])
        assert args.benchmark == benchmark.name and args.short


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["scenarios"], "unknown benchmark 'scenarios'"),
        (["routing", "--sequential", "--seeds", "1"], "--seeds does not apply to --sequential"),
        (["routing", "--no-plots"], "--no-plots does not apply to the scenario suite"),
        (["--policies", "nope"], "unknown policies ['nope']"),
        (["classes", "--policies", "nope"], "unknown policies ['nope']"),
        (["cost", "--batch-size", "0"], "--batch-size is a number of sequences, at least 1: 0"),
    ],
)
def test_flags_that_make_no_run_are_refused_with_a_sentence(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().out
