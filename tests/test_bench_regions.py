"""The regions benchmark's report, rendered from a committed run's file against the committed
Markdown, and its typed results read back from the file as they were written."""

from __future__ import annotations

import json

import pytest
from harness.golden import BENCH, check, updating

from bench.regions.config import EXTRA_POLICIES, default_regions_config
from bench.regions.load import Sent
from bench.regions.report import WAVE_LIMIT, load, markdown, over_limit
from bench.regions.results import Overload, RegionsRun
from bench.regions.stack import POOL, gate_objects, replica_pool
from policies import parse_object
from policies.models import Pool, RoutingPolicy


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


def _sent(ttft: float, replica: str = "us-east-1", status: int = 200) -> Sent:
    return Sent(fleet="us-east", start=0.0, status=status, replica=replica, ttft=ttft)


def test_the_wave_counts_its_requests_over_the_line_and_the_most_that_may_cross() -> None:
    # Before: p99 120 ms, so the line is 180 ms; with an 80 ms round trip a crossing request
    # is over it when its TTFT at once is over 100 ms, as 10% of those before were.
    before = [_sent(0.09)] * 90 + [_sent(0.12)] * 10
    during = (
        [_sent(0.1)] * 190
        + [_sent(0.3)] * 5  # stayed and waited
        + [_sent(0.19, "eu-west-1")] * 4  # crossed: at once plus the round trip
        + [_sent(0.17, "eu-west-2")]  # crossed, under the line
        + [_sent(0.0, status=503)]  # failed: not served, not counted
    )
    over = over_limit(before, during, rtt=0.08)
    assert over is not None
    assert over.limit_s == pytest.approx(WAVE_LIMIT * 0.12)
    assert (over.crossed, over.stayed, over.allowed) == (4, 5, 2)
    assert over.crossing_chance == pytest.approx(0.1)
    # The p99 of 200 lets 2 pass the line: 20 crossing requests, a tenth of the wave's.
    assert over.most_crossing == pytest.approx(0.1)
    assert over_limit([], during, rtt=0.08) is None
    # No request before was within the round trip of the line: any share may cross.
    free = over_limit(before, during, rtt=0.01)
    assert free is not None and free.most_crossing == 1.0


def test_the_gate_policy_sends_each_region_through_a_gate_to_the_other_by_name() -> None:
    """``--policies gate``: per region a pool the agents fill, behind an auto gate with no
    share, and the other region's replicas as an external pool; every object is valid."""
    config = default_regions_config()
    a, b = config.regions
    bodies = gate_objects(config, {a: 10001, b: 10002}, {a: [8001, 8002], b: [8003, 8004]})
    parsed = {(o.kind, o.metadata.name): o for o in (parse_object(body) for body in bodies)}
    far = parsed[("Pool", f"far-{b}")]
    assert isinstance(far, Pool) and far.spec.external
    assert {e.port for e in far.spec.endpoints} == {8003, 8004}
    policy = parsed[("RoutingPolicy", f"chat-{a}")]
    assert isinstance(policy, RoutingPolicy) and policy.spec.fleets == [a]
    (route,) = policy.spec.routes
    assert [t.pool for t in route.tiers[0].pools] == [replica_pool(a, gate=True)]
    assert route.overflow is not None and route.overflow.pools == [f"far-{b}"]
    assert (route.overflow.max_in_flight, route.overflow.max_share) == ("auto", 0)
    assert replica_pool(a, gate=False) == POOL and "gate" in EXTRA_POLICIES
