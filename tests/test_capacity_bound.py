"""Bounded load that follows the replicas' batch capacity (``sessionAffinity.capacityBound``):
the factor ``100 * batch / mean in flight``, its ladder of twins with hysteresis, the route
model's defaults, and where it lands in the plan and in Envoy's resources (one twin per rung,
the route entry's cluster)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from harness.builders import policy, pool
from pydantic import ValidationError

from compiler.compile import PolicyState, compile_plan
from policies.models import (
    BOUNDED_LOAD_LADDER,
    UNBOUNDED_RUNG,
    Endpoint,
    Pool,
    Route,
    RoutingPolicy,
)
from signals.saturation import (
    LOOSEN_DWELL,
    LOOSEN_MARGIN,
    PEAK_HOLD,
    SaturationDecision,
    capacity_factor,
    decide_bound,
    exported_bound,
    held_peak,
    in_flight,
    unbounded_at,
    usable_batch,
)
from signals.telemetry import TelemetryRecord
from xdsserver.translate import translate

LADDER = (100, 125, 150, 200, 300, 450)
FULL = (*LADDER, UNBOUNDED_RUNG)
"""A route's whole ladder (``SessionAffinity.ladder``): the six bounds, then none."""
USUAL = 125
NOW = 1000.0
PORTS = (8001, 8002, 8003, 8004)


def record(
    running: float, waiting: float = 0.0, *, at: float = NOW - 1, batch: float | None = 8
) -> TelemetryRecord:
    return TelemetryRecord(at=at, running=running, waiting=waiting, max_running=batch)


def _state(
    running: float, previous: SaturationDecision | None = None, *, batch: float | None = 32
) -> PolicyState:
    """A telemetry route at its defaults over four replicas running `running` each in
    batches of `batch` (32: the ladder; 8: the fixed bounds, ``ladder_pays``)."""
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
                        "sessionAffinity": {"capacityBound": True},
                        "tiers": [["p"]],
                    }
                ],
            )
        ),
    ]
    return PolicyState.from_objects(
        objects,
        telemetry={"p": {f"127.0.0.1:{port}": record(running, batch=batch) for port in PORTS}},
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


def at(factor: int, since: float = NOW - 100) -> SaturationDecision:
    """A decision at rung `factor` since `since`, after a round that saw an idle pool (its held
    peak faded to nothing)."""
    return SaturationDecision(
        saturated=factor == 100,
        since=since,
        factor=factor,
        peak=0.0,
        peak_at=since,
        ladder=True,
    )


@pytest.mark.parametrize(
    ("batch", "usable"),
    [
        pytest.param(8, 8 - math.sqrt(8), id="8: 5.2, a third kept free"),
        pytest.param(32, 32 - math.sqrt(32), id="32: 26.3"),
        pytest.param(128, 128 - math.sqrt(128), id="128: 116.7, a tenth kept free"),
        pytest.param(2, 1, id="never below one sequence"),
    ],
)
def test_the_usable_batch_keeps_a_square_root_of_the_batch_free(
    batch: float, usable: float
) -> None:
    assert usable_batch(batch) == pytest.approx(usable)


@pytest.mark.parametrize(
    ("batch", "mean", "factor"),
    [
        pytest.param(8, 4, 100 * (8 - math.sqrt(8)) / 4, id="batches of 8 half full: 129"),
        pytest.param(8, 6, 100 * (8 - math.sqrt(8)) / 6, id="8, three quarters full: 86"),
        pytest.param(32, 12, 100 * (32 - math.sqrt(32)) / 12, id="32 at 12 in flight: 220"),
        pytest.param(128, 40, 100 * (128 - math.sqrt(128)) / 40, id="128 at 40: 292"),
        pytest.param(8, 0, math.inf, id="idle: no bound needed"),
    ],
)
def test_the_bound_lets_the_busiest_replica_fill_the_usable_batch(
    batch: float, mean: float, factor: float
) -> None:
    assert capacity_factor(batch, mean) == pytest.approx(factor)


@pytest.mark.parametrize(
    ("previous", "load", "factor"),
    [
        pytest.param(None, None, USUAL, id="no batch size known: the usual bound"),
        pytest.param(at(300), None, USUAL, id="telemetry gone: back to the usual bound"),
        pytest.param(None, (30, 128), 300, id="first evidence: the loosest bound that fits (389%)"),
        pytest.param(None, (2, 32), 450, id="first evidence: a bound, no bound after the dwell"),
        pytest.param(at(125), (4, 8), 125, id="batches of 8 half full: 125, the largest <= 129"),
        pytest.param(at(125), (11, 32), 200, id="batches of 32 a third full: 200"),
        pytest.param(
            at(125),
            (usable_batch(32) / 2, 32),
            150,
            id="exactly 200 allowed: the margin keeps 150",
        ),
        pytest.param(at(125), (30, 128), 300, id="batches of 128 under a quarter: the top rung"),
        pytest.param(None, (6, 8), 100, id="batches of 8 three quarters full: the floor at once"),
        pytest.param(at(125), (9, 8), 100, id="queues: the floor"),
        pytest.param(at(300), (20, 32), 125, id="tightens at once, down to what fits"),
        pytest.param(at(200, NOW - 1), (16, 32), 150, id="tightens even within the dwell"),
        pytest.param(at(450), (5.9, 32), 450, id="446%: within the margin below its rung, kept"),
        pytest.param(at(450), (6.75, 32), 300, id="390%: past the margin, tightens"),
        pytest.param(at(150), (12.5, 32), 150, id="200 allowed but not cleared by the margin"),
        pytest.param(at(150), (11.5, 32), 200, id="cleared by the margin: looser"),
        pytest.param(at(150, NOW - 1), (8, 32), 150, id="looser only after the dwell"),
        pytest.param(at(100), (2, 32), 450, id="after the dwell, straight to the rung it clears"),
    ],
)
def test_the_rung_tightens_at_once_and_loosens_with_margin_and_dwell(
    previous: SaturationDecision | None, load: tuple[float, float] | None, factor: int
) -> None:
    decision = decide_bound(previous, load, now=NOW, ladder=LADDER, usual=USUAL)
    assert decision.factor == factor
    assert decision.saturated is (factor == LADDER[0])
    before = previous.factor if previous else USUAL
    if previous is None and load is not None:
        assert decision.since == NOW  # the first evidence starts the dwell
    else:
        assert decision.since == (
            NOW if factor != before else (previous.since if previous else -math.inf)
        )


@pytest.mark.parametrize(
    ("replicas", "at_factor"),
    [
        pytest.param(8, 800.0, id="8 replicas: 800%, all in flight fit one usable batch"),
        pytest.param(5, 500.0, id="5 replicas: 500%"),
        pytest.param(4, 450.0, id="4 replicas: never below the last bound (450)"),
        pytest.param(2, 450.0, id="2 replicas: 450 too"),
        pytest.param(0, math.inf, id="no replica reporting: never"),
    ],
)
def test_no_bound_from_a_factor_of_100_per_replica_reporting(
    replicas: int, at_factor: float
) -> None:
    assert unbounded_at(replicas, FULL) == at_factor


def unbounded(since: float = NOW - 100) -> SaturationDecision:
    return at(UNBOUNDED_RUNG, since)


# Batches of 128 (116.7 usable) over eight replicas: no bound from 800%, a mean of 14.6 in
# flight, and looser to it only at 880% (13.3 in flight).
@pytest.mark.parametrize(
    ("previous", "mean", "replicas", "factor"),
    [
        pytest.param(at(300), 5, 8, UNBOUNDED_RUNG, id="calm (2334%): no bound"),
        pytest.param(at(125), 5, 8, UNBOUNDED_RUNG, id="from any rung, after the dwell"),
        pytest.param(at(300, NOW - 1), 5, 8, 300, id="not within the dwell"),
        pytest.param(at(450), 13.5, 8, 450, id="864%: clears 800 but not by the margin"),
        pytest.param(at(300), 13.5, 8, 450, id="864%: clears 450 by the margin"),
        pytest.param(at(300), 13.0, 8, UNBOUNDED_RUNG, id="898%: cleared by the margin"),
        pytest.param(unbounded(), 13.5, 8, UNBOUNDED_RUNG, id="864% keeps no bound"),
        pytest.param(unbounded(NOW - 1), 15, 8, UNBOUNDED_RUNG, id="778%: within the margin"),
        pytest.param(unbounded(NOW - 1), 17, 8, 450, id="686%: tightens at once, in the dwell"),
        pytest.param(unbounded(), 60, 8, 150, id="the pool fills: straight to what fits"),
        pytest.param(unbounded(), 130, 8, 100, id="queues: the floor"),
        pytest.param(unbounded(), 11, 12, 450, id="more replicas report: 1061% < 1200%"),
        pytest.param(at(450), 1, 0, 450, id="without a count of replicas: never unbounded"),
    ],
)
def test_no_bound_while_the_pool_fits_one_batch_and_tightens_at_once_when_it_fills(
    previous: SaturationDecision, mean: float, replicas: int, factor: int
) -> None:
    decision = decide_bound(
        previous, (mean, 128), now=NOW, ladder=FULL, usual=USUAL, replicas=replicas
    )
    assert decision.factor == factor
    assert decision.since == (previous.since if factor == previous.factor else NOW)


def test_a_burst_takes_the_bound_back_and_its_fading_peak_gives_it_up_again() -> None:
    """Eight replicas at batch 128: calm, the first record holds the loosest bound through the
    dwell, then no bound; a burst tightens at once; the peak it leaves loosens the rung only
    as it fades (by e in 30 s) and no sooner than the dwell, back to no bound at last, each
    step due at ``calm_at`` without new telemetry."""

    def step(previous: SaturationDecision | None, mean: float, now: float) -> SaturationDecision:
        return decide_bound(previous, (mean, 128), now=now, ladder=FULL, usual=USUAL, replicas=8)

    first = step(None, 4, NOW)
    assert first.factor == 450 and first.calm_at == NOW + LOOSEN_DWELL
    calm = step(first, 4, first.calm_at)
    assert calm.factor == UNBOUNDED_RUNG and calm.calm_at == math.inf
    burst = step(calm, 50, NOW + 20)  # 233%
    assert burst.factor == 200 and burst.peak == 50
    assert burst.calm_at == math.inf  # nothing is due while the burst lasts
    rungs, later = [], step(burst, 4, NOW + 21)
    assert later.factor == 200
    while later.factor != UNBOUNDED_RUNG:
        due = later.calm_at
        assert due > later.since and math.isfinite(due)
        later = step(later, 4, due + 1e-6)
        rungs.append((later.factor, round(later.since - burst.since)))
    # The peak of 50 fades to 35.4 (330%: 300) in 10 s, held to the dwell's 15 s; to 23.6
    # (495%: 450) in 23 s, held to the next dwell's 30 s; to 13.3 (880%: no bound) in 40 s,
    # held to 45 s.
    assert [r for r, _ in rungs] == [300, 450, UNBOUNDED_RUNG]
    assert [s for _, s in rungs] == [15, 30, 45]
    assert PEAK_HOLD * math.log(50 / 23.57) < 30 and PEAK_HOLD * math.log(50 / 13.26) < 45


def test_operators_see_no_bound_as_0() -> None:
    assert exported_bound(UNBOUNDED_RUNG) == 0
    assert exported_bound(300) == 300


def test_a_looser_rung_held_back_by_its_dwell_is_due_when_the_dwell_ends() -> None:
    held = decide_bound(at(150, NOW - 1), (7, 32), now=NOW, ladder=LADDER, usual=USUAL)
    assert held.factor == 150 and held.calm_at == NOW - 1 + LOOSEN_DWELL
    later = decide_bound(held, (7, 32), now=held.calm_at, ladder=LADDER, usual=USUAL)
    assert later.factor == 300 and later.calm_at == math.inf
    # Nothing looser to wait for: no rebuild due.
    assert decide_bound(at(150), (24, 32), now=NOW, ladder=LADDER, usual=USUAL).calm_at == (
        math.inf
    )


def test_noise_around_a_rung_changes_nothing_within_the_margin() -> None:
    """A pool whose factor wanders between a rung and the rung above times the margin keeps
    its rung: no route update at all."""
    decision = at(150)
    for mean in (16.0, 15.0, 16.5, 14.6, 17.0, 15.5):
        assert 150 <= capacity_factor(32, mean) < 200 * LOOSEN_MARGIN
        decision = decide_bound(decision, (mean, 32), now=NOW, ladder=LADDER, usual=USUAL)
        assert decision.factor == 150


@pytest.mark.parametrize(
    ("previous", "mean", "peak"),
    [
        pytest.param(None, 3.0, 3.0, id="no peak yet: this round's mean"),
        pytest.param(
            SaturationDecision(factor=125, peak=8.0, peak_at=NOW - PEAK_HOLD),
            2.0,
            8.0 / math.e,
            id="a lull: the peak decayed by e over the hold",
        ),
        pytest.param(
            SaturationDecision(factor=125, peak=8.0, peak_at=NOW - PEAK_HOLD),
            4.0,
            4.0,
            id="busier than the faded peak: this round's mean",
        ),
        pytest.param(
            SaturationDecision(factor=125, peak=8.0, peak_at=NOW), 2.0, 8.0, id="no time passed"
        ),
    ],
)
def test_the_rung_follows_the_held_peak_of_the_mean(
    previous: SaturationDecision | None, mean: float, peak: float
) -> None:
    assert held_peak(previous, mean, now=NOW) == pytest.approx(peak)


def test_a_lull_loosens_the_rung_only_as_its_peak_fades_and_a_burst_tightens_at_once() -> None:
    """Batches of 8: a pool at 4 in flight takes 125%; a lull to 0.5 in flight would allow
    1034% at once, but the rung follows the faded peak, no sooner than the dwell after each
    change; the burst that ends the lull tightens it in the same round."""
    busy = decide_bound(None, (4, 8), now=NOW, ladder=LADDER, usual=USUAL)
    assert busy.factor == 125 and busy.peak == 4
    rungs, later = [], busy
    for seconds in (6, 16, 24, 32):
        later = decide_bound(later, (0.5, 8), now=NOW + seconds, ladder=LADDER, usual=USUAL)
        rungs.append(later.factor)
    # The peak of 4 faded to 3.3 (158%, within the dwell), 2.3 (220%: 200), 1.8 (288%, within
    # the dwell of that change) and 1.4 (374%: 300).
    assert rungs == [125, 200, 200, 300]
    assert later.peak == pytest.approx(4 * math.exp(-32 / PEAK_HOLD))
    burst = decide_bound(later, (6, 8), now=NOW + 33, ladder=LADDER, usual=USUAL)
    assert burst.factor == 100 and burst.peak == 6


def test_a_fading_peak_is_due_for_a_rebuild_without_new_telemetry() -> None:
    """An agent writes a record only when its numbers move: the control plane rebuilds at
    ``calm_at``, when the faded peak clears the next rung, whether or not telemetry came."""
    busy = decide_bound(at(125), (4, 8), now=NOW, ladder=LADDER, usual=USUAL)
    lull = decide_bound(busy, (0.5, 8), now=NOW + 6, ladder=LADDER, usual=USUAL)
    assert lull.factor == 125 and lull.peak is not None
    target = usable_batch(8) * 100 / (150 * LOOSEN_MARGIN)
    assert lull.calm_at == pytest.approx(NOW + 6 + PEAK_HOLD * math.log(lull.peak / target))
    due = decide_bound(lull, (0.5, 8), now=lull.calm_at + 1e-6, ladder=LADDER, usual=USUAL)
    assert due.factor == 150
    # A mean above what the next rung needs: nothing is due until telemetry says otherwise.
    held = decide_bound(busy, (4, 8), now=NOW + 60, ladder=LADDER, usual=USUAL)
    assert held.factor == 125 and held.calm_at == math.inf


def test_without_evidence_the_peak_is_forgotten() -> None:
    busy = decide_bound(None, (4, 8), now=NOW, ladder=LADDER, usual=USUAL)
    gone = decide_bound(busy, None, now=NOW + 1, ladder=LADDER, usual=USUAL)
    assert gone.factor == USUAL and gone.peak is None
    back = decide_bound(gone, (0.5, 8), now=NOW + 2, ladder=LADDER, usual=USUAL)
    assert back.peak == 0.5


def test_in_flight_is_the_mean_over_fresh_records_that_know_their_batch() -> None:
    endpoints = [Endpoint(address="10.0.0.1", port=port) for port in PORTS]
    telemetry = {
        "10.0.0.1:8001": record(8, 4, batch=16),
        "10.0.0.1:8002": record(4, batch=32),
        "10.0.0.1:8003": record(8, at=NOW - 60),  # stale: left out
        "10.0.0.1:8004": record(8, batch=None),  # no batch size
    }
    assert in_flight(endpoints, telemetry, now=NOW, max_age=10) == (8.0, 24.0)
    assert in_flight(endpoints[2:], telemetry, now=NOW, max_age=10) is None


# --------------------------------------------------------------------------- the route model


def _affinity(**route: Any) -> Any:
    affinity = Route.model_validate({"name": "r", "tiers": [["p"]], **route}).session_affinity
    assert affinity is not None
    return affinity


@pytest.mark.parametrize(
    ("route", "ladder"),
    [
        pytest.param({"balancing": "telemetry", "sessionAffinity": {}}, FULL, id="on by default"),
        pytest.param(
            {"balancing": "telemetry", "sessionAffinity": {"capacityBound": True}},
            FULL,
            id="turned on",
        ),
        pytest.param(
            {
                "balancing": "telemetry",
                "sessionAffinity": {"capacityBound": True, "saturatedHashBalanceFactor": 150},
            },
            (125, 150, 200, 300, 450, UNBOUNDED_RUNG),
            id="the saturated bound is the floor; the usual one stays a rung",
        ),
        pytest.param(
            {
                "balancing": "telemetry",
                "sessionAffinity": {"capacityBound": True, "hashBalanceFactor": 175},
            },
            (100, 125, 150, 175, 200, 300, 450, UNBOUNDED_RUNG),
            id="an own usual bound is a rung",
        ),
        pytest.param(
            {"balancing": "telemetry", "sessionAffinity": {"capacityBound": False}},
            (),
            id="turned off: two fixed bounds",
        ),
        pytest.param(
            {"balancing": "telemetry", "sessionAffinity": {"hashBalanceFactor": 0}},
            (),
            id="bounded load off stays off",
        ),
        pytest.param({"sessionAffinity": {}}, (), id="not a telemetry route"),
    ],
)
def test_a_telemetry_route_follows_capacity_unless_told_not_to(
    route: dict[str, Any], ladder: tuple[int, ...]
) -> None:
    assert _affinity(**route).ladder() == ladder
    assert BOUNDED_LOAD_LADDER == LADDER


@pytest.mark.parametrize(
    ("route", "message"),
    [
        pytest.param(
            {"sessionAffinity": {"capacityBound": True}},
            "capacityBound needs balancing: telemetry",
            id="needs telemetry",
        ),
        pytest.param(
            {
                "balancing": "telemetry",
                "sessionAffinity": {"capacityBound": True, "hashBalanceFactor": 0},
            },
            "capacityBound needs bounded load",
            id="needs bounded load",
        ),
    ],
)
def test_a_capacity_bound_that_cannot_work_is_refused(route: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Route.model_validate({"name": "r", "tiers": [["p"]], **route})


# --------------------------------------------------------------------------- plan and Envoy


def test_session_requests_take_the_twin_whose_bound_fits_the_batch() -> None:
    # Batches of 32, 26.3 of them usable, over four replicas: 4 in flight each allow 658%,
    # past 4 x 100% (all 16 in flight fit one replica's usable batch): no bound. 7 allow 376%
    # (the top bound), 20 allow 132% (125), 27 are past the usable part (98%: the floor).
    calm = compile_plan(_state(running=4, previous=at(125)))
    assert calm.saturation["r/live"].factor == UNBOUNDED_RUNG
    assert _session_clusters(calm) == {"r/live/affinity-unbounded"}

    warm = compile_plan(_state(running=7, previous=calm.saturation["r/live"]))
    assert warm.saturation["r/live"].factor == 300
    assert _session_clusters(warm) == {"r/live/affinity-300"}

    busy = compile_plan(_state(running=20, previous=warm.saturation["r/live"]))
    assert busy.saturation["r/live"].factor == 125
    assert _session_clusters(busy) == {"r/live/affinity"}

    full = compile_plan(_state(running=27, previous=busy.saturation["r/live"]))
    assert full.saturation["r/live"].factor == 100
    assert _session_clusters(full) == {"r/live/affinity-saturated"}

    # Only the route entries change (RDS): every twin exists either way, on one ring.
    resources = [translate(plan.fleets[0]) for plan in (calm, warm, busy, full)]
    assert all(r.clusters == resources[0].clusters for r in resources)
    assert resources[0].endpoints == resources[3].endpoints
    twins = {
        c.name: c.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value
        for c in resources[0].clusters
        if c.name.startswith("r/live/affinity")
    }
    assert twins == {
        "r/live/affinity": 125,
        "r/live/affinity-saturated": 100,
        "r/live/affinity-150": 150,
        "r/live/affinity-200": 200,
        "r/live/affinity-300": 300,
        "r/live/affinity-450": 450,
        "r/live/affinity-unbounded": 0,
    }
    # The twin without a bound is the plain consistent hash of the same ring: no bounded
    # load configured at all, the same ring size.
    by_name = {c.name: c for c in resources[0].clusters}
    unbounded, bounded = by_name["r/live/affinity-unbounded"], by_name["r/live/affinity-450"]
    assert not unbounded.common_lb_config.HasField("consistent_hashing_lb_config")
    assert unbounded.lb_policy == bounded.lb_policy
    assert unbounded.ring_hash_lb_config == bounded.ring_hash_lb_config
    services = {
        c.eds_cluster_config.service_name
        for c in resources[0].clusters
        if c.name.startswith("r/live")
    }
    assert len(services) == 1


def _twin_factors(resources: Any) -> dict[str, int]:
    return {
        c.name: c.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value
        for c in resources.clusters
        if c.name.startswith("r/live/affinity")
    }


def test_batches_of_8_compile_to_the_fixed_bounds_twins_and_their_route_entries() -> None:
    """At batches too small for the ladder (``ladder_pays``) the route compiles to what the
    same route without ``capacityBound`` compiles to: two twins, the session entries on the
    usual one while calm and on the saturated one while the batches are full."""
    calm = compile_plan(_state(running=1, batch=8))
    decision = calm.saturation["r/live"]
    assert decision.ladder is False and decision.factor == 0 and not decision.saturated
    assert decision.path == "batch 8: ladder needs > 16; fixed bounds"
    assert _session_clusters(calm) == {"r/live/affinity"}
    full = compile_plan(_state(running=7, previous=decision, batch=8))
    assert full.saturation["r/live"].saturated is True
    assert _session_clusters(full) == {"r/live/affinity-saturated"}

    resources = translate(calm.fleets[0])
    assert _twin_factors(resources) == {"r/live/affinity": 125, "r/live/affinity-saturated": 100}
    assert resources.clusters == translate(full.fleets[0]).clusters

    # The same route without capacityBound, on the same telemetry: the same resources.
    fixed = _state(running=1, batch=8)
    spec = fixed.policies["r"].spec
    route = spec.routes[0]
    assert route.session_affinity is not None
    plain = route.model_copy(
        update={
            "session_affinity": route.session_affinity.model_copy(update={"capacity_bound": False})
        }
    )
    fixed.policies["r"] = fixed.policies["r"].model_copy(
        update={"spec": spec.model_copy(update={"routes": [plain]})}
    )
    theirs = translate(compile_plan(fixed).fleets[0])
    assert theirs.clusters == resources.clusters and theirs.routes == resources.routes


def test_without_a_known_batch_size_the_route_keeps_its_ladder_of_twins() -> None:
    """Before any record knows its batch size the route compiles to its ladder, as it asks;
    the first record of a small batch drops the three twins the fixed bounds do not use
    (a cluster update), and the two left keep their names."""
    unknown = compile_plan(_state(running=1, batch=None))
    assert unknown.saturation["r/live"].ladder is True
    # Every bound, and the twin without one (0).
    assert set(_twin_factors(translate(unknown.fleets[0])).values()) == {*LADDER, 0}
    small = compile_plan(_state(running=1, previous=unknown.saturation["r/live"], batch=8))
    assert _twin_factors(translate(small.fleets[0])) == {
        "r/live/affinity": 125,
        "r/live/affinity-saturated": 100,
    }
