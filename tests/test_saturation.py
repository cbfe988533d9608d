"""Bounded load that tightens while a telemetry route's replicas are saturated: the decision
(batch fill with hysteresis), its defaults in the route model, and where it lands in the plan
and in Envoy's resources (a second hash twin; the route entry's cluster)."""

from __future__ import annotations

from typing import Any

import pytest
from harness.builders import policy, pool
from pydantic import ValidationError

from compiler.compile import PolicyState, compile_plan
from policies.models import Pool, Route, RoutingPolicy
from signals.saturation import (
    CALM_SHARE,
    MIN_DWELL,
    SaturationDecision,
    batch_fill,
    decide_saturation,
    saturated_fill,
)
from signals.telemetry import TelemetryRecord
from xdsserver.translate import SATURATED_SUFFIX, translate

NOW = 1000.0
PORTS = (8001, 8002, 8003, 8004)


def record(running: float, waiting: float = 0.0, *, at: float = NOW - 1, batch: float = 8) -> Any:
    return TelemetryRecord(at=at, running=running, waiting=waiting, max_running=batch)


# --------------------------------------------------------------------------- the decision

BOUND = saturated_fill(125)
CALM_FILL = BOUND * CALM_SHARE
SATURATED = SaturationDecision(saturated=True, since=NOW - MIN_DWELL - 1)
JUST_SATURATED = SaturationDecision(saturated=True, since=NOW - 1)
CALM = SaturationDecision(saturated=False, since=NOW - 100)


@pytest.mark.parametrize(
    ("factor", "fill"),
    [
        pytest.param(125, 0.8, id="125%: the busiest replica full at a mean fill of 0.8"),
        pytest.param(150, 100 / 150, id="150%: at two thirds"),
        pytest.param(100, 1.0, id="100%: only when every batch is full"),
        pytest.param(0, 1.0, id="no bound: only when every batch is full"),
    ],
)
def test_a_route_saturates_where_its_usual_bound_lets_a_batch_overflow(
    factor: int, fill: float
) -> None:
    assert saturated_fill(factor) == pytest.approx(fill)


@pytest.mark.parametrize(
    ("previous", "fill", "saturated"),
    [
        pytest.param(None, None, False, id="no telemetry: calm"),
        pytest.param(None, 0.7, False, id="room in the batches: calm"),
        pytest.param(None, BOUND, True, id="batches full enough: saturated at once"),
        pytest.param(CALM, 1.4, True, id="queues: saturated"),
        pytest.param(CALM, BOUND - 0.01, False, id="just under the bound: stays calm"),
        pytest.param(SATURATED, CALM_FILL + 0.01, True, id="between the bounds: stays saturated"),
        pytest.param(SATURATED, CALM_FILL, False, id="down to the calm bound: calm again"),
        pytest.param(JUST_SATURATED, 0.2, True, id="calm too soon after saturating: held"),
        pytest.param(JUST_SATURATED, None, False, id="telemetry gone: calm at once"),
    ],
)
def test_saturation_follows_batch_fill_with_hysteresis(
    previous: SaturationDecision | None, fill: float | None, saturated: bool
) -> None:
    decision = decide_saturation(previous, fill, now=NOW, bound=BOUND)
    assert decision.saturated is saturated
    assert decision.fill == fill
    changed = saturated != (previous.saturated if previous else False)
    assert decision.since == (NOW if changed else (previous.since if previous else -float("inf")))


def test_batch_fill_is_the_mean_over_fresh_records_that_know_their_batch() -> None:
    from policies.models import Endpoint

    endpoints = [Endpoint(address="10.0.0.1", port=port) for port in PORTS]
    telemetry = {
        "10.0.0.1:8001": record(8, 4),  # 1.5: a queue counts above a full batch
        "10.0.0.1:8002": record(4),  # 0.5
        "10.0.0.1:8003": record(8, at=NOW - 60),  # stale: left out
        "10.0.0.1:8004": TelemetryRecord(at=NOW - 1, running=8),  # no batch size: left out
    }
    assert batch_fill(endpoints, telemetry, now=NOW, max_age=10) == 1.0
    assert batch_fill(endpoints[2:], telemetry, now=NOW, max_age=10) is None


# --------------------------------------------------------------------------- the route model


def _affinity(**route: Any) -> Any:
    affinity = Route.model_validate({"name": "r", "tiers": [["p"]], **route}).session_affinity
    assert affinity is not None
    return affinity


@pytest.mark.parametrize(
    ("route", "calm", "saturated"),
    [
        pytest.param({"balancing": "telemetry", "sessionAffinity": {}}, 125, 100, id="defaults"),
        pytest.param(
            {"balancing": "telemetry", "sessionAffinity": {"saturatedHashBalanceFactor": 110}},
            125,
            110,
            id="own saturated bound",
        ),
        pytest.param(
            {"balancing": "telemetry", "sessionAffinity": {"saturatedHashBalanceFactor": 0}},
            125,
            0,
            id="turned off",
        ),
        pytest.param(
            {"balancing": "telemetry", "sessionAffinity": {"hashBalanceFactor": 0}},
            0,
            0,
            id="bounded load off stays off",
        ),
        pytest.param({"sessionAffinity": {}}, 150, 0, id="not a telemetry route"),
    ],
)
def test_a_telemetry_route_tightens_to_100_when_saturated_unless_told_otherwise(
    route: dict[str, Any], calm: int, saturated: int
) -> None:
    affinity = _affinity(**route)
    assert (affinity.hash_balance_factor, affinity.saturated_hash_balance_factor) == (
        calm,
        saturated,
    )


@pytest.mark.parametrize(
    ("route", "message"),
    [
        pytest.param(
            {"sessionAffinity": {"saturatedHashBalanceFactor": 100}},
            "saturatedHashBalanceFactor needs balancing: telemetry",
            id="needs telemetry",
        ),
        pytest.param(
            {"balancing": "telemetry", "sessionAffinity": {"saturatedHashBalanceFactor": 90}},
            r"saturatedHashBalanceFactor must be 0 \(off\) or at least 100",
            id="below 100",
        ),
    ],
)
def test_a_saturated_bound_that_cannot_work_is_refused(route: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Route.model_validate({"name": "r", "tiers": [["p"]], **route})


# --------------------------------------------------------------------------- plan and Envoy


def _state(
    running: float,
    previous: SaturationDecision | None = None,
    affinity: dict[str, Any] | None = None,
) -> PolicyState:
    """A telemetry route over four replicas running `running` each in batches of 8; two
    fixed bounds unless `affinity` says otherwise."""
    objects = [
        Pool.model_validate(pool("p", list(PORTS))),
        RoutingPolicy.model_validate(
            policy(
                "r",
                10000,
                [
                    {
                        "name": "live",
                        "balancing": "telemetry",
                        "sessionAffinity": (
                            {"capacityBound": False} if affinity is None else affinity
                        ),
                        "tiers": [["p"]],
                    }
                ],
            )
        ),
    ]
    telemetry = {f"127.0.0.1:{port}": record(running) for port in PORTS}
    return PolicyState.from_objects(
        objects,
        telemetry={"p": telemetry},
        previous_saturation={"r/live": previous} if previous else {},
        now=NOW,
    )


def _session_clusters(plan: Any) -> set[str]:
    """The clusters of the route entries that hash on the session header."""
    resources = translate(plan.fleets[0])
    return {
        entry.route.cluster
        for configuration in resources.routes
        for vhost in configuration.virtual_hosts
        for entry in vhost.routes
        if entry.route.hash_policy
    }


def test_saturated_replicas_send_session_requests_to_the_tighter_twin_of_the_same_ring() -> None:
    calm = compile_plan(_state(running=2))
    assert calm.saturation["r/live"].saturated is False
    assert _session_clusters(calm) == {"r/live/affinity"}

    saturated = compile_plan(_state(running=8, previous=calm.saturation["r/live"]))
    assert saturated.saturation["r/live"].saturated is True
    assert _session_clusters(saturated) == {"r/live" + SATURATED_SUFFIX}

    # Only the route entries change (RDS): both twins exist either way, with the same
    # endpoints, and differ in their bound alone.
    calm_resources, saturated_resources = translate(calm.fleets[0]), translate(saturated.fleets[0])
    assert calm_resources.clusters == saturated_resources.clusters
    assert calm_resources.endpoints == saturated_resources.endpoints
    assert calm_resources.routes != saturated_resources.routes
    twins = {c.name: c for c in calm_resources.clusters if c.name.startswith("r/live/affinity")}
    usual, tight = twins["r/live/affinity"], twins["r/live" + SATURATED_SUFFIX]
    assert usual.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value == 125
    assert tight.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value == 100
    assert tight.eds_cluster_config.service_name == usual.eds_cluster_config.service_name
    assert (tight.lb_policy, tight.ring_hash_lb_config) == (
        usual.lb_policy,
        usual.ring_hash_lb_config,
    )


def test_a_saturated_route_already_calm_is_rebuilt_when_its_dwell_ends() -> None:
    held = decide_saturation(JUST_SATURATED, 0.2, now=NOW, bound=BOUND)
    assert held.saturated and held.calm_at == JUST_SATURATED.since + MIN_DWELL
    assert decide_saturation(JUST_SATURATED, 0.7, now=NOW, bound=BOUND).calm_at == float("inf")
    assert decide_saturation(CALM, 0.2, now=NOW, bound=BOUND).calm_at == float("inf")
    assert decide_saturation(held, 0.2, now=held.calm_at, bound=BOUND).saturated is False
