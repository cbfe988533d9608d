"""The TTFT tail breakdown and the warm-cache oracle of the routing benchmark (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.rig.analysis import TailBreakdown, classify, own_prefill_seconds, tail_breakdown
from bench.rig.loadgen import RequestResult
from bench.rig.workload import WorkloadConfig, cache_blind_cost, generate, oracle_hit_rate
from replicasim.simulator import SimConfig

SIM = SimConfig(max_batched_tokens=2048, decode_base=0.02, prefill_per_token=1 / 4000)


def request(
    session: str, turn: int, replica: str, ttft: float, prompt: int, cached: int
) -> RequestResult:
    return RequestResult(
        session=session,
        turn=turn,
        start=0.0,
        replica=replica,
        ttft=ttft,
        prompt_tokens=prompt,
        cached_tokens=cached,
        status=200,
    )


@pytest.mark.parametrize(
    ("turns", "kinds"),
    [
        ([("r0", 1000, 900)], ["first turn"]),
        ([("r0", 1000, 900), ("r0", 2000, 1800)], ["first turn", "warm"]),
        ([("r0", 1000, 900), ("r1", 2000, 900)], ["first turn", "moved"]),
        ([("r0", 1000, 900), ("r0", 2000, 400)], ["first turn", "evicted"]),
    ],
)
def test_classify_names_each_turn_by_where_its_history_was(
    turns: list[tuple[str, int, int]], kinds: list[str]
) -> None:
    requests = [
        request("s", index, replica, 0.1, prompt, cached)
        for index, (replica, prompt, cached) in enumerate(turns)
    ]
    assert [r.kind for r in classify(list(reversed(requests)))] == kinds


def test_own_prefill_counts_steps_of_the_token_budget() -> None:
    assert own_prefill_seconds(0, SIM) == pytest.approx(0.02)
    assert own_prefill_seconds(4096, SIM) == pytest.approx(2 * 0.02 + 4096 / 4000)


def test_tail_breakdown_picks_the_slowest_and_splits_their_time() -> None:
    requests = [request(f"s{i}", 0, "r0", 0.05, 100, 96) for i in range(98)]
    requests += [
        request("slow", 0, "r0", 0.05, 100, 96),
        request("slow", 1, "r1", 3.0, 4000, 0),  # moved: its history stayed on r0
    ]
    breakdown = tail_breakdown(requests, SIM)
    assert breakdown is not None
    tail = breakdown.tail
    assert tail.kinds == {"moved": 1}
    assert tail.own_prefill_mean == pytest.approx(own_prefill_seconds(4000, SIM))
    assert tail.wait_share == pytest.approx(1 - own_prefill_seconds(4000, SIM) / 3.0)
    assert breakdown.by_kind["first turn"].requests == 99
    # A kind with no request is only its count in the file, as it always was.
    assert breakdown.to_json()["by_kind"]["evicted"] == {"requests": 0}
    assert TailBreakdown.from_json(breakdown.to_json()) == breakdown
    assert tail_breakdown([], SIM) is None


def test_warm_system_prompts_raise_the_oracle_and_lower_the_cache_blind_cost() -> None:
    workload = generate(WorkloadConfig(duration=10.0, session_rate=1.0, max_turns=3))
    warm = workload.system_prompts()
    assert 1 <= len(warm) <= len(workload.config.system_prompts)
    assert oracle_hit_rate(workload, warm=warm) > oracle_hit_rate(workload)
    sim = replace(SimConfig(), kv_blocks=4096)
    assert cache_blind_cost(workload, sim, 4, warm) < cache_blind_cost(workload, sim, 4)
