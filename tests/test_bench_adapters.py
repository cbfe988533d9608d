"""The adapters benchmark's workload and report, without a stack."""

from __future__ import annotations

import collections

from bench.adapters.report import markdown
from bench.adapters.run import AdaptersConfig, Outcome, arrivals, summarize


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
    def result(loads: float) -> dict[str, object]:
        return {
            "ttftP50": 0.1,
            "ttftP99": 0.5,
            "adapterLoads": loads,
            "loadsPer1000": loads,
            "errors": 0,
            "servedByReplica": {"replica-0": 10},
        }

    config = {"replicas": 8, "adapters": 40, "zipf": 1.0, "max_loaded": 8, "load_time": 0.5}
    config |= {"requests": 1000, "rate": 24.0}
    text = markdown({"config": config, "results": {"blind": result(400), "aware": result(100)}})
    assert "met, aware loads 25.0% as often" in text
    text = markdown({"config": config, "results": {"blind": result(400), "aware": result(300)}})
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
    assert (result["requests"], result["errors"], result["adapterLoads"]) == (4, 1, 8)
    assert (result["steadyRequests"], result["steadyLoads"]) == (3, 1)
    assert result["steadyLoadsPer1000"] == 1000 / 3
    assert result["steadyTtftP99"] is not None and result["steadyTtftP99"] < 0.1
