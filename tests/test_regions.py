"""Regions, zones and capacity kinds: validation of the fields, each fleet's priorities by
place and kind, and the spill loop (its cut, hold band, floor, dwell and comeback ramp)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from harness.regions import two_region_state
from pydantic import ValidationError

from compiler import compile_plan
from compiler.locality import FAR, NEAR, REGION, place_rank
from compiler.plan import PlanEndpoint
from policies import Endpoint, Fleet, Pool
from policies.models import Locality
from signals import PolicyState
from signals.spill import DWELL, FLOOR, STEP, SpillDecision, decide_spill
from signals.telemetry import TelemetryRecord


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"capacity": "preemptible"}, "capacity", "on-demand"),
        ({"locality": {"zone": "us-east-a"}}, "locality", "has no region"),
        ({"locality": {"region": "us east"}}, "locality.region", "pattern"),
    ],
)
def test_bad_capacity_or_locality_is_refused_naming_the_field(
    body: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        Endpoint.model_validate({"address": "10.0.0.1", "port": 8000, **body})
    error = caught.value.errors()[0]
    assert ".".join(str(p) for p in error["loc"]).startswith(field)
    assert words in str(caught.value)


def test_a_fleet_zone_without_a_region_is_refused() -> None:
    with pytest.raises(ValidationError, match="has no region"):
        Fleet.model_validate(
            {"kind": "Fleet", "metadata": {"name": "us"}, "spec": {"locality": {"zone": "a"}}}
        )


def test_a_capacity_kind_listed_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match="twice"):
        Pool.model_validate(
            {
                "kind": "Pool",
                "metadata": {"name": "p"},
                "spec": {"preferCapacity": ["spot", "spot"]},
            }
        )


def _endpoint(region: str, zone: str = "") -> PlanEndpoint:
    return PlanEndpoint("p", "10.0.0.1", 80, 100, 0, region=region, zone=zone)


@pytest.mark.parametrize(
    ("endpoint", "where", "rank"),
    [
        (_endpoint("us", "a"), Locality(region="us", zone="a"), NEAR),
        (_endpoint("us", "b"), Locality(region="us", zone="a"), REGION),
        (_endpoint("us", "b"), Locality(region="us"), NEAR),
        (_endpoint("eu", "a"), Locality(region="us", zone="a"), FAR),
        (_endpoint(""), Locality(region="us"), FAR),
        (_endpoint("eu"), None, NEAR),
    ],
)
def test_place_rank(endpoint: PlanEndpoint, where: Locality | None, rank: int) -> None:
    assert place_rank(endpoint, where) == rank


@pytest.mark.parametrize(
    ("previous", "local", "fill", "now", "keep"),
    [
        (None, 4, 0.5, 10.0, 1.0),  # calm: keep everything
        (None, 4, 1.5, 10.0, 0.85),  # queueing: cut, at most to 0.85 of itself in a step
        (None, 4, 1.1, 10.0, 0.8636),  # 1.0 x 0.95 / 1.1
        (SpillDecision(keep=0.75, since=9.0, local=4), 4, 2.0, 10.0, 0.75),  # within dwell
        (SpillDecision(keep=0.75, since=5.0, local=4), 4, 0.9, 10.0, 0.75),  # hold band
        (SpillDecision(keep=0.75, since=5.0, local=4), 4, 0.5, 10.0, 0.75 + STEP),  # room
        (SpillDecision(keep=0.55, since=5.0, local=4), 4, 5.0, 10.0, FLOOR),  # floor holds
        # still queueing, but less than at the last cut: the queue drains, hold
        (SpillDecision(keep=0.85, since=5.0, local=4, step_fill=1.3), 4, 1.2, 10.0, 0.85),
        # queueing as much as at the last cut: cut again
        (SpillDecision(keep=0.85, since=5.0, local=4, step_fill=1.2), 4, 1.2, 10.0, 0.7225),
        (SpillDecision(keep=0.9, since=5.0, local=4), 0, None, 10.0, FLOOR),  # region down
        (SpillDecision(keep=FLOOR, since=5.0, local=0, outage=True), 4, None, 10.0, FLOOR),
        (None, 0, None, 10.0, 1.0),  # a new fleet whose replicas have not registered yet
        (SpillDecision(keep=1.0, local=0), 4, 0.5, 10.0, 1.0),  # ... and once they have
    ],
)
def test_spill_steps(
    previous: SpillDecision | None, local: int, fill: float | None, now: float, keep: float
) -> None:
    assert decide_spill(previous, local=local, fill=fill, now=now).keep == pytest.approx(keep)


def test_a_region_that_comes_back_ramps_to_all_of_its_traffic_by_steps() -> None:
    decision = decide_spill(SpillDecision(keep=1.0, local=4), local=0, fill=None, now=0.0)
    now = 1.0
    decision = decide_spill(decision, local=4, fill=0.3, now=now)
    assert (decision.keep, decision.since) == (FLOOR, now)
    shares = []
    while decision.keep < 1.0:
        assert decision.next_at == decision.since + DWELL
        now = decision.next_at
        decision = decide_spill(decision, local=4, fill=0.3, now=now)
        shares.append(decision.keep)
    assert shares == sorted(shares) and len(shares) == round((1 - FLOOR) / STEP)
    assert decision.overprovisioning == 140 and decision.next_at == float("inf")


def _state(*, fill_us: float, now: float = 100.0, **live: Any) -> PolicyState:
    """Region us's two replicas filled to ``fill_us`` of their batch (above 1: queueing)."""
    telemetry = {
        f"10.0.1.{i}:8000": TelemetryRecord(
            at=now - 0.5,
            running=16 * min(fill_us, 1),
            waiting=16 * max(0, fill_us - 1),
            max_running=16,
        )
        for i in (1, 2)
    }
    return two_region_state(telemetry, now=now, **live)


def _factor(plan: Any, fleet: str) -> int:
    return int(next(c for c in plan.fleet(fleet).clusters).overprovisioning)


def test_only_the_saturated_fleet_spills_and_calm_brings_it_back() -> None:
    plan = compile_plan(_state(fill_us=1.5))
    assert (_factor(plan, "us"), _factor(plan, "eu")) == (85, 0)
    # Still queueing, but within the dwell: no second cut yet.
    plan = compile_plan(_state(fill_us=1.5, now=103.0, previous_spill=plan.spill))
    assert _factor(plan, "us") == 85
    # Queueing still after the dwell: cut again.
    plan = compile_plan(_state(fill_us=1.5, now=106.0, previous_spill=plan.spill))
    assert _factor(plan, "us") == 72
    # Room again: it takes back by steps.
    plan = compile_plan(_state(fill_us=0.4, now=112.0, previous_spill=plan.spill))
    assert _factor(plan, "us") == 82


def test_each_fleet_prefers_its_own_region() -> None:
    plan = compile_plan(_state(fill_us=0.5))
    for fleet, own in (("us", "10.0.1."), ("eu", "10.0.2.")):
        cluster = plan.fleet(fleet).clusters[0]  # type: ignore[union-attr]
        first = {e.address for e in cluster.endpoints if e.priority == 0}
        assert first and all(address.startswith(own) for address in first)
        assert {e.priority for e in cluster.endpoints} == {0, 1}


def test_no_spill_into_a_locality_that_queues_as_well() -> None:
    assert decide_spill(None, local=4, fill=1.5, now=10.0, next_fill=1.3).keep == 1.0
    assert decide_spill(None, local=4, fill=1.5, now=10.0, next_fill=0.5).keep == 0.85


def test_a_region_whose_replicas_all_left_takes_its_traffic_back_from_the_floor() -> None:
    """The fleet's own region empties (its agents withdrew every registration), then its
    replicas register again: the fleet keeps only half of its traffic at home at first."""
    gone = _state(fill_us=0.5, now=100.0)
    pool = gone.pools["llama"]
    eu_only = pool.model_copy(
        update={
            "spec": pool.spec.model_copy(
                update={
                    "endpoints": [e for e in pool.spec.endpoints if e.address.startswith("10.0.2.")]
                }
            )
        }
    )
    before = compile_plan(_state(fill_us=0.5, now=99.0))
    gone = replace(gone, previous_spill=before.spill)
    plan = compile_plan(replace(gone, pools={**gone.pools, "llama": eu_only}))
    assert plan.spill["us/chat/chat"].local == 0 and plan.spill["us/chat/chat"].outage
    assert _factor(plan, "us") == 0  # one priority: nothing to spill to, Envoy's default
    back = compile_plan(_state(fill_us=0.5, now=101.0, previous_spill=plan.spill))
    assert _factor(back, "us") == 50


def test_an_envoy_gets_the_view_of_its_node_locality_else_its_fleet() -> None:
    from envoy.config.core.v3 import base_pb2

    from xdsserver.snapshot import Snapshot, SnapshotCache

    cache = SnapshotCache()
    for name in ("default", "edge", "edge@us-east", "edge@eu-west/eu-west-b"):
        cache.set_snapshot(name, Snapshot({}))

    def node(cluster: str, region: str = "", zone: str = "") -> base_pb2.Node:
        return base_pb2.Node(
            id="n", cluster=cluster, locality=base_pb2.Locality(region=region, zone=zone)
        )

    assert cache.served_fleet(node("edge", "us-east", "us-east-a")) == "edge@us-east"
    assert cache.served_fleet(node("edge", "eu-west", "eu-west-b")) == "edge@eu-west/eu-west-b"
    assert cache.served_fleet(node("edge", "ap-south")) == "edge"
    assert cache.served_fleet(node("edge")) == "edge"
    assert cache.served_fleet(node("other", "us-east")) == "default"


def test_a_fleet_with_node_locality_gets_a_view_per_region_and_zone() -> None:
    state = _state(fill_us=0.5)
    edge = Fleet.model_validate(
        {"kind": "Fleet", "metadata": {"name": "us"}, "spec": {"nodeLocality": True}}
    )
    plan = compile_plan(replace(state, fleets={**state.fleets, "us": edge}))
    names = [f.fleet for f in plan.fleets]
    assert {"us", "us@us", "us@eu"} <= set(names), names
    eu_view = plan.fleet("us@eu")
    assert eu_view is not None
    first = {e.address for e in eu_view.clusters[0].endpoints if e.priority == 0}
    assert first == {"10.0.2.1", "10.0.2.2"}
    blind = plan.fleet("us")
    assert blind is not None and {e.priority for e in blind.clusters[0].endpoints} == {0}
