"""The adapters benchmark's workload and report, without a stack."""

from __future__ import annotations

import collections
import json

from harness.golden import BENCH, check, updating

from bench.adapters.config import AdaptersConfig
from bench.adapters.report import load, markdown
from bench.adapters.results import AdapterRun
from bench.adapters.run import Outcome, arrivals, summarize


def test_arrivals_are_the_same_for_every_policy_and_zipf_popular() -> None:
    config = AdaptersConfig(requests=4000, rate=100.0)
    plan = arrivals(config)
    assert plan == arrivals(config)
    counts = collections.Counter(adapter for _, adapter in plan)
    # Zipf(1) over 40: the first adapter about 23%, the second half of that.
    assert 0.19 < counts["lora-0"] / 4000 < 0.27
    assert counts["lora-0"] > counts["lora-1"] > counts["lora-9"]
    assert 35 < plan[-1][0] < 45  # 4000 requests at 100/s


def test_the_report_says_whether_aware_routing_halved_the_loads() -> None:
    def result(loads: float) -> AdapterRun:
        # As a file of a run from before the steady part was kept has it.
        return AdapterRun.from_json(
            {
                "requests": 1000,
                "ttftP50": 0.1,
                "ttftP99": 0.5,
                "adapterLoads": loads,
                "loadsPer1000": loads,
                "errors": 0,
                "servedByReplica": {"replica-0": 10},
            }
        )

    config = AdaptersConfig(requests=1000, rate=24.0)
    text = markdown(config, {"blind": result(400), "aware": result(100)})
    assert "met, aware loads 25.0% as often" in text
    assert "Steady state" not in text
    text = markdown(config, {"blind": result(400), "aware": result(300)})
    assert "NOT met" in text


def test_the_steady_part_counts_requests_after_the_warmup_and_loads_since_then() -> None:
    outcomes = [
        Outcome("lora-0", 200, 0.6, "replica-0", offset=1.0),
        Outcome("lora-0", 200, 0.05, "replica-0", offset=30.0),
        Outcome("lora-1", 200, 0.07, "replica-1", offset=31.0),
        Outcome("lora-1", 503, None, "envoy", offset=32.0),
    ]
    result = summarize(
        outcomes,
        {"replica-0": 5, "replica-1": 3},
        40.0,
        warmup=20.0,
        warm_loads={"replica-0": 4, "replica-1": 3},
    )
    assert (result.requests, result.errors, result.adapter_loads) == (4, 1, 8)
    steady = result.steady
    assert steady is not None
    assert (steady.requests, steady.loads) == (3, 1)
    assert steady.loads_per_1000 == 1000 / 3
    assert steady.ttft_p99 is not None and steady.ttft_p99 < 0.1
    # The JSON file's camelCase keys, read back to the same run.
    assert result.to_json()["steadyLoadsPer1000"] == 1000 / 3
    assert AdapterRun.from_json(result.to_json()) == result


def test_the_report_rendered_from_a_runs_file_is_the_committed_markdown() -> None:
    """A real ``--short`` run read back from its JSON file: both tables, the target and the
    requests per replica; and each policy's entry as the file has it, key for key."""
    config, results = load(BENCH / "adapters-short.json")
    check({"adapters-short.md": markdown(config, results)}, BENCH, update=updating())
    data = json.loads((BENCH / "adapters-short.json").read_text())["results"]
    assert [list(r.to_json().items()) for r in results.values()] == [
        list(entry.items()) for entry in data.values()
    ]
