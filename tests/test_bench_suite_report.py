"""The scenario suite's own arithmetic (pooled percentiles, the weight timeline, the
targets), and its report rendered from a committed run's files against the committed
Markdown, so a change to the report cannot pass unseen.

Regenerate the expected Markdown (after a change to the report that is meant) with
``KVPILOT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_bench_suite_report.py``, and
review the diff.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from harness.golden import BENCH, check, updating

from bench.rig.loadgen import RequestResult
from bench.routing import sequential_report
from bench.routing.measure import goodput, weight_moves
from bench.routing.report import load, markdown, rerender
from bench.routing.results import (
    AroundSlowdown,
    Measured,
    SlowPeriod,
    WeightMoves,
)
from bench.routing.scenarios import SlowEvent
from bench.routing.sequential import POLICIES
from bench.routing.targets import _share_evidence, capacity_ceiling, pooled_p99, targets

GOLDEN = BENCH
"""Files of real ``--short`` runs (requests trimmed to a few per run) and their reports."""
WRITTEN = "2026-12-03 17:51:26"
"""The time the committed reports name (a report names the time it is written)."""


def _request(engine: float | None, *, ok: bool = True, **more: Any) -> RequestResult:
    """A request whose engine timed its first token at `engine` seconds."""
    return RequestResult(
        session="s",
        turn=0,
        start=more.pop("start", 0.0),
        status=200 if ok else 503,
        error="" if ok else "HTTP 503",
        engine_ttft=engine,
        **more,
    )


def _measured(**fields: Any) -> Measured:
    """A run's numbers with the given fields; the rest as a quiet run has them."""
    base: dict[str, Any] = {
        name: None
        for name in [
            "hit_rate",
            "ttft_p50",
            "ttft_p99",
            "latency_p99",
            "requests_per_s",
            "load_max_over_mean",
            "in_flight_mean",
            "engine_ttft_mean",
            "ttft_mean",
            "client_ttft_p50",
            "client_ttft_p99",
            "goodput_per_s",
            "goodput_share",
            "hit_vs_oracle",
            "engine_hit_rate",
            "prefill_share",
        ]
    }
    base |= {
        "requests": 0, "ok": 0, "errors": 0, "error_kinds": {}, "timed_out": False,
        "makespan_s": 0.0, "served": {}, "wall_seconds": 0.0, "oracle_hit_rate": 0.0,
        "moved": 0, "moved_share": 0.0, "seed": 1, "batch": 8,
    }  # fmt: skip
    return Measured(**(base | fields))


def test_pooled_p99_reads_every_seed_and_skips_failures() -> None:
    seed_a = [_request(t / 100) for t in range(1, 101)]
    seed_b = [_request(t / 100 + 1.0) for t in range(1, 101)] + [_request(99.0, ok=False)]
    # 200 successful requests: the 198th smallest.
    assert pooled_p99([_measured(per_request=seed_a), _measured(per_request=seed_b)]) == 1.98
    assert pooled_p99([_measured()]) is None


def test_weight_moves_counts_changes_and_times_the_slowed_replica() -> None:
    event = SlowEvent(replica=0, factor=3.0, start=8.0, end=20.0)
    timeline = [
        (5.0, [100.0, 100.0]),
        (9.0, [100.0, 100.0]),
        (11.5, [35.0, 100.0]),
        (15.0, [35.0, 100.0]),
        (21.0, [35.0, 100.0]),
        (24.0, [50.0, 100.0]),
        (27.0, [100.0, 100.0]),
    ]
    moves = weight_moves(timeline, event)
    # The ring share from 5 s after the slowdown to its end (the sample at 15 s; 21 s is
    # after it): 35/135 against 1/2 before.
    assert moves == WeightMoves(3, AroundSlowdown(3.5, 7.0, (35 / 135) / 0.5))
    # The file keeps the slowdown's keys beside the count, as it always did.
    assert moves.to_json() == {
        "weight_changes": 3,
        "fell_after": 3.5,
        "back_after": 7.0,
        "ring_share_drop": (35 / 135) / 0.5,
    }
    assert WeightMoves.from_json(moves.to_json()) == moves
    slowdown = weight_moves(timeline[:2], event).slowdown
    assert slowdown is not None and slowdown.fell_after is None
    assert weight_moves(timeline, None).to_json() == {"weight_changes": 3}


def test_the_share_of_new_sessions_is_also_given_with_the_seeds_pooled_and_as_a_ring_share() -> (
    None
):
    def run(before: list[int], after: list[int], ring: float) -> Measured:
        # As the results file has them: the counts are JSON lists.
        slow = {"new_sessions_before": before, "new_sessions_after_5s": after}
        weights = {"weight_changes": 0, "ring_share_drop": ring}
        return replace(
            _measured(),
            slow=SlowPeriod.from_json(slow),
            weights=WeightMoves.from_json(weights),
        )

    runs = [run([2, 14], [2, 26], 0.38), run([0, 12], [1, 18], 0.53), run([2, 16], [0, 27], 0.38)]
    # 3 of 71 after against 4 of 42 before; a seed with none before has no ratio of its own.
    assert _share_evidence(runs) == (
        "; seeds pooled 0.44x (4 of 42 new sessions before, 3 of 71 after); ring share 0.38x"
    )
    empty = replace(
        _measured(),
        slow=SlowPeriod.from_json({}),
        weights=WeightMoves.from_json({"weight_changes": 0}),
    )
    assert _share_evidence([empty]) == ""


def test_the_overload_target_says_what_any_router_could_reach_at_most() -> None:
    """Round robin spent 20% of its engines' time on prompt tokens at a hit rate of 80%; the
    oracle's 95% leaves a quarter of those tokens: 1 / (1 - 0.2 * 0.75) = 1.176x."""
    rr = {"prefill_share": 0.2, "engine_hit_rate": 0.8, "oracle_hit_rate": 0.95}
    assert capacity_ceiling(_measured(**rr)) == pytest.approx(1 / (1 - 0.2 * 0.75))
    assert capacity_ceiling(_measured(**{**rr, "prefill_share": None})) is None
    assert capacity_ceiling(_measured(**{**rr, "engine_hit_rate": 0.97})) == 1.0  # past it

    def run(requests_per_s: float, **engine: float) -> Measured:
        return _measured(requests_per_s=requests_per_s, ttft_p99=1.0, hit_rate=0.9, **engine)

    results = {
        "overload@8": {
            "round_robin": [run(10.0, **rr)],
            "affinity": [run(10.5)],
            "kvpilot": [run(10.4)],
        },
        # Round robin's engines spent 2% of their time on prompts: any router's ceiling is
        # 1.015x, and the route met it.
        "overload@32": {
            "round_robin": [run(10.0, **{**rr, "prefill_share": 0.02})],
            "kvpilot": [run(10.15)],
        },
    }
    found = {t[0]: t for t in targets(results) if "req/s" in t[1]}
    assert found["overload@8"][2] is False
    assert "1.04x" in found["overload@8"][3]
    assert "ceiling for any router 1.18x" in found["overload@8"][3]
    assert "spent 20% of their time on prompt tokens" in found["overload@8"][3]
    assert found["overload@32"][2] is True
    assert "ceiling for any router 1.02x" in found["overload@32"][3]


def test_goodput_at_another_objective_counts_over_the_measured_window() -> None:
    """A report read again at another objective divides by the run's measured window, as
    the run itself did, not by the span from the first request to the last answer."""
    per_request = [
        _request(0.2, ttft=9.0, start=30.0, engine_latency=60.0),
        _request(0.6, ttft=0.6, start=40.0, engine_latency=5.0),
        _request(None, ttft=0.1, start=50.0, engine_latency=5.0),
        _request(0.1, ok=False),
    ]
    # The engines' 0.2 s counts, not the client's 9 s; without an engine time, the client's.
    good = goodput(per_request, 0.5, window=55.0)
    assert (good.per_s, good.share) == (2 / 55.0, 2 / 4)
    assert goodput(per_request, 1.0, window=55.0).per_s == 3 / 55.0
    assert goodput([], 1.0, window=55.0).share is None


@pytest.mark.parametrize("interval", [0.6, 1.2, 2.4])
def test_a_fleets_telemetry_outlives_its_agents_refresh(interval: float) -> None:
    """The agent writes a record nothing moved again after 3 intervals (its refresh), at
    the first scrape after that: a record must stay fresh for longer, or a learned capacity
    weight falls back to the static one between two refreshes (it did at batch size 128,
    2.4 s an interval, with a fixed 5 s)."""
    from types import SimpleNamespace

    from bench.routing.fleets import pool_body
    from policies.models import Pool

    replica = SimpleNamespace(host="127.0.0.1", port=9000)
    fleet = SimpleNamespace(pool="p", replicas=[replica], policy=None)
    pool = Pool.model_validate(pool_body(fleet, agent_interval=interval))  # type: ignore[arg-type]
    telemetry = pool.spec.telemetry
    assert telemetry is not None
    assert telemetry.max_age > 4 * interval
    assert telemetry.max_age >= 5.0


def _golden(name: str, text: str) -> None:
    """`text` against the committed ``tests/golden/bench/<name>``."""
    check({name: text}, BENCH, update=updating())


def test_the_suite_report_rendered_from_a_runs_files_is_the_committed_markdown() -> None:
    """A real ``--short`` run (two seeds, the heterogeneous fleet and the slowdown, the A/A
    copy): every table, the slowdown's windows, the noise line and the targets."""
    run = load(GOLDEN / "scenarios-short.json")
    text = markdown(run.config, run.policies, run.workloads, run.results, written=WRITTEN)
    _golden("scenarios-short.md", text)


def test_the_suite_files_read_back_are_the_files_written(tmp_path: Path) -> None:
    """A run re-rendered writes the results it read: the same numbers under the same keys in
    the same order, the optional sections left out where they were (slow, weights,
    bound_changes); goodput alone is counted again, from the requests file (trimmed here)."""
    for name in ("scenarios-short.json", "scenarios-short-requests.json"):
        shutil.copy(GOLDEN / name, tmp_path / name)
    report = rerender(tmp_path / "scenarios-short.json")

    def entries(data: dict[str, Any]) -> list[tuple[str, str, list[tuple[str, Any]]]]:
        """Every entry's items in order, goodput's left out."""
        return [
            (key, policy, [(k, v) for k, v in m.items() if not k.startswith("goodput")])
            for key, by in data["results"].items()
            for policy, runs in by.items()
            for m in runs
        ]

    written = json.loads(report.with_suffix(".json").read_text())
    committed = json.loads((GOLDEN / "scenarios-short.json").read_text())
    assert entries(written) == entries(committed)
    assert written["workloads"] == committed["workloads"]
    requests = report.with_name(report.stem + "-requests.json")
    assert json.loads(requests.read_text()) == json.loads(
        (GOLDEN / "scenarios-short-requests.json").read_text()
    )


def test_a_results_file_of_an_older_run_is_read_with_what_it_lacks_as_none() -> None:
    """Optional keys a file lacks are None, keys this version does not know are ignored."""
    data = json.loads((GOLDEN / "scenarios-short.json").read_text())
    entry = dict(data["results"]["hetero@8"]["kvpilot"][0])
    for key in ("prefill_share", "engine_hit_rate", "batch", "bound_changes", "weights"):
        del entry[key]
    entry["a_later_number"] = 1.0
    measured = Measured.from_json(entry)
    assert measured.prefill_share is None and measured.batch is None
    assert measured.weights is None and measured.bound_changes is None
    assert measured.ttft_p99 == entry["ttft_p99"]
    assert "a_later_number" not in measured.to_json()
    # A number every file has is named when it is missing.
    del entry["requests"]
    with pytest.raises(ValueError, match="Measured: the file has no 'requests'"):
        Measured.from_json(entry)


def test_the_sequential_report_rendered_from_a_runs_file_is_the_committed_markdown() -> None:
    """A real ``--sequential --short`` run: both workloads' tables, the telemetry line, the
    targets, the tail breakdown and the setup block."""
    run = sequential_report.load(GOLDEN / "routing-short.json")
    text = sequential_report.markdown(
        groups=run.groups,
        titles={p.key: p.title for p in POLICIES},
        config_dict=run.config_dict,
        plots=run.plots,
        written=WRITTEN,
    )
    _golden("routing-short.md", text)
    # Read back, each policy's entry is the one the run wrote, key for key, in order.
    data = json.loads((GOLDEN / "routing-short.json").read_text())
    entries = {key: r.to_json() for g in run.groups for key, r in g.results.items()}
    assert [list(e.items()) for e in entries.values()] == [
        list(data["policies"][key].items()) for key in entries
    ]
