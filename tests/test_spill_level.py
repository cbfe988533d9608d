"""A locality levels with the cluster's mean load when the others have room (a spot wave),
and takes ``LOAD`` of its capacity when they do not (an overload whose total is the
cluster's capacity): pure, no Envoy, no etcd."""

from __future__ import annotations

from typing import Any

import pytest

from compiler import compile_plan
from policies import RoutingPolicy
from signals import PolicyState
from signals.spill import (
    BALANCE_FROM,
    BALANCE_GAP,
    BALANCE_HOLD,
    FLOOR,
    LOAD,
    SpillDecision,
    decide_spill,
)
from signals.telemetry import TelemetryRecord
from tests.harness.regions import two_region_objects, two_region_state

# The regions benchmark's spot wave: us-east has 2 of its 4 replicas left (4.3 requests/s)
# for its fleet's 3.8/s; the cluster's 5 replicas serve both fleets' 7.6/s at 72%.
WAVE = {"arrivals": 3.8, "capacity": 4.3, "mean_load": 0.72}


def _ff(previous: SpillDecision | None, **kwargs: Any) -> SpillDecision:
    args: dict[str, Any] = {"local": 2, "fill": 0.9, "now": 100.0, "healthy": 1.0}
    args.update(kwargs)
    return decide_spill(previous, **args)


def test_a_locality_far_over_the_mean_levels_with_it() -> None:
    decision = _ff(None, **WAVE)
    # Without the mean it keeps everything: 88% of its capacity is under LOAD.
    assert _ff(None, arrivals=3.8, capacity=4.3).keep == 1.0
    assert decision.balancing and decision.level == 0.72
    assert decision.keep == pytest.approx(0.72 * 4.3 / 3.8, abs=1e-4)


def test_when_the_whole_cluster_is_full_only_the_excess_crosses() -> None:
    # Region A at 130%, region B at 70%: the mean is the cluster's capacity.
    decision = _ff(None, arrivals=11.0, capacity=8.5, mean_load=1.0)
    assert decision.balancing and decision.level == LOAD
    assert decision.keep == pytest.approx(LOAD * 8.5 / 11.0, abs=1e-4)


@pytest.mark.parametrize(
    ("arrivals", "mean_load"),
    [
        (0.78 * 8.5, 0.7),  # a steady 70% whose arrivals came high: within the gap
        (0.75 * 8.5, 0.3),  # far over an idle cluster, but under BALANCE_FROM: no queue
        (1.2 * 8.5, None),  # the mean is not known: LOAD as before
    ],
)
def test_a_locality_near_the_mean_or_with_little_load_keeps_its_level(
    arrivals: float, mean_load: float | None
) -> None:
    decision = _ff(None, arrivals=arrivals, capacity=8.5, mean_load=mean_load)
    assert not decision.balancing and decision.level == LOAD
    assert decision.keep == pytest.approx(min(1.0, LOAD * 8.5 / arrivals), abs=1e-4)


def test_levelling_holds_within_its_hysteresis_and_ends_beyond_it() -> None:
    first = _ff(None, **WAVE)
    own = 3.8 / 4.3
    # The gap narrows to under BALANCE_GAP but not BALANCE_HOLD: still levelling.
    narrower = _ff(first, **(WAVE | {"mean_load": own - BALANCE_GAP + 0.01}), now=101.0)
    assert narrower.balancing
    assert not _ff(None, **(WAVE | {"mean_load": own - BALANCE_GAP + 0.01})).balancing
    # Within BALANCE_HOLD of the mean, or the locality's load under BALANCE_FROM less the
    # hold: it stops.
    level = _ff(narrower, **(WAVE | {"mean_load": own - BALANCE_HOLD / 2}), now=102.0)
    assert not level.balancing
    quiet = BALANCE_FROM - BALANCE_HOLD - 0.02
    calm = _ff(narrower, **(WAVE | {"arrivals": quiet * 4.3, "mean_load": 0.4}), now=102.0)
    assert not calm.balancing and calm.keep == 1.0


def test_the_floor_holds_under_levelling() -> None:
    decision = _ff(None, arrivals=10.0, capacity=4.3, mean_load=0.3)
    assert decision.balancing and decision.keep == FLOOR


def _wave_state(arrivals: dict[str, float], eu_running: float) -> Any:
    """us: one replica serving (one gone), 16 slots, 8 s a request (2/s); eu: two replicas
    running `eu_running` of their 16 slots each."""
    telemetry = {
        "10.0.1.1:8000": TelemetryRecord(at=99.5, running=15, waiting=0, max_running=16),
    } | {
        f"10.0.2.{i}:8000": TelemetryRecord(at=99.5, running=eu_running, waiting=0, max_running=16)
        for i in (1, 2)
    }
    return two_region_state(
        telemetry,
        arrivals=arrivals,
        service_times={key: 8.0 for key in telemetry},
        draining=("10.0.1.2",),
    )


def test_the_compiled_mean_counts_every_fleets_arrivals_over_every_serving_replica() -> None:
    # us's fleet 1.8/s, eu's 2.4/s, over 3 serving replicas of 2/s each (the draining one
    # left out): 70%, and us (90%) levels with it.
    plan = compile_plan(_wave_state({"us/chat/chat": 1.8, "eu/chat/chat": 2.4}, eu_running=9))
    us = plan.spill["us/chat/chat"]
    assert us.mean_load == pytest.approx(4.2 / 6.0, abs=1e-4)
    assert us.balancing and us.keep == pytest.approx(0.7 * 2.0 / 1.8, abs=1e-4)
    assert plan.fleet("us").clusters[0].overprovisioning == round(100 * us.keep)
    assert not plan.spill["eu/chat/chat"].balancing


def test_traffic_no_arrivals_log_reports_raises_the_mean_by_the_slots_that_run() -> None:
    # eu's replicas run 15 of 16 though no eu fleet reports: the cluster is full, not idle.
    plan = compile_plan(_wave_state({"us/chat/chat": 1.8}, eu_running=15))
    us = plan.spill["us/chat/chat"]
    assert us.mean_load == pytest.approx(45 / 48, abs=1e-4)
    assert not us.balancing and us.keep == 1.0


def test_the_mean_counts_the_routes_of_other_policies_over_the_same_pool() -> None:
    # One policy per fleet (as the regions benchmark has): eu's arrivals come on its own
    # policy's route, over the same pool, and count; a route that is not there does not.
    extra = RoutingPolicy.model_validate(
        {
            "kind": "RoutingPolicy",
            "metadata": {"name": "chat-eu"},
            "spec": {
                "fleets": ["eu"],
                "listener": {"port": 10001},
                "routes": [{"name": "all", "tiers": [["llama"]]}],
            },
        }
    )
    telemetry = _wave_state({}, eu_running=9).telemetry["llama"]
    state = PolicyState.from_objects(
        [*two_region_objects(draining=("10.0.1.2",)), extra],
        telemetry={"llama": dict(telemetry)},
        now=100.0,
        arrivals={"us/chat/chat": 1.8, "eu/chat-eu/all": 2.4, "eu/gone/all": 50.0},
        service_times={key: 8.0 for key in telemetry},
    )
    us = compile_plan(state).spill["us/chat/chat"]
    assert us.mean_load == pytest.approx(4.2 / 6.0, abs=1e-4)
    assert us.balancing
