"""``overflow.utilization``: the share of their measured capacity the owned replicas carry
with ``signal: arrivals`` before the paid pools take the rest of the route's demand."""

from __future__ import annotations

import json

import pytest
from harness.builders import arrivals_overflow
from harness.overflow import compiled_arrivals
from pydantic import ValidationError

from controlplane.decode import decode
from policies import parse_object
from policies.models import Overflow, RoutingPolicy
from policies.models.overflow import UTILIZATION, UTILIZATION_STORED_BEFORE
from signals.overflowff import PRIOR_SHARE, ArrivalsDecision, decide_arrivals
from signals.overflowwork import SAMPLE_WINDOW
from signals.spill import LOAD, LOW_FILL

NOW = 1_000_000.0
PORTS = (8001, 8002, 8003, 8004)


def test_utilization_defaults_to_0_9_and_bad_values_name_the_field() -> None:
    unset = Overflow.model_validate({"pools": ["paid"]})
    assert unset.utilization is None and unset.owned_share() == UTILIZATION == 0.9
    # Stored unset, so a later default applies to it.
    assert unset.model_dump(mode="json", by_alias=True)["utilization"] is None
    assert Overflow.model_validate({"pools": ["paid"], "utilization": 0.8}).owned_share() == 0.8
    assert Overflow.model_validate({"pools": ["paid"], "utilization": 0.8}).utilization == 0.8
    for bad in (0, -0.5, 1.2, "most"):
        with pytest.raises(ValidationError, match="utilization"):
            Overflow.model_validate({"pools": ["paid"], "utilization": bad})
    # The loop has its own bound (fill): a utilization set for it is refused, named.
    with pytest.raises(ValidationError, match="utilization is for signal: arrivals"):
        Overflow.model_validate({"pools": ["paid"], "signal": "fill", "utilization": 0.8})
    # Unset, as the loop's routes are stored now, it is not.
    Overflow.model_validate({"pools": ["paid"], "signal": "fill"})
    with pytest.raises(ValidationError, match="utilization is for signal: arrivals"):
        Overflow.model_validate({"pools": ["paid"], "signal": "fill", "utilization": 0.9})


def test_a_loop_route_stored_by_an_earlier_version_still_loads() -> None:
    # Versions before 0.9 stored every overflow with its defaults filled in (utilization
    # 0.97), the fill loop's routes too: such a stored policy still decodes, and an
    # arrivals route stored so keeps the 0.97 it was stored with.
    for signal in ("fill", "arrivals"):
        body = parse_object(arrivals_overflow(PORTS, signal=signal)[2])
        stored = body.model_dump(mode="json", by_alias=True)
        stored["spec"]["routes"][0]["overflow"]["utilization"] = UTILIZATION_STORED_BEFORE
        decoded = decode("objects/routingpolicies/main", json.dumps(stored).encode())
        assert isinstance(decoded, RoutingPolicy), signal
        overflow = decoded.spec.routes[0].overflow
        assert overflow is not None and overflow.signal == signal
        assert overflow.owned_share() == 0.97


def _round(
    previous: ArrivalsDecision | None, demand: float, *, load: float, now: float, fill: float
) -> ArrivalsDecision:
    # 32 slots at 4 s a request: a prior capacity of 0.7 x 8/s.
    return decide_arrivals(
        previous,
        demand=demand,
        slots=32,
        running=min(1.0, fill),
        fill=fill,
        completions=None,
        service_time=4.0,
        now=now,
        load=load,
    )


def test_a_lower_utilization_sends_more_of_the_same_demand_to_paid() -> None:
    capacity = PRIOR_SHARE * 8.0
    default = _round(None, 9.0, load=LOAD, now=NOW, fill=0.9)
    lower = _round(None, 9.0, load=0.8, now=NOW, fill=0.9)
    assert default.paid == pytest.approx(1 - LOAD * capacity / 9.0, abs=1e-3)
    assert lower.paid == pytest.approx(1 - 0.8 * capacity / 9.0, abs=1e-3)
    assert lower.paid > default.paid
    assert "above 0.80 x capacity" in lower.why
    # Demand within the default's share but above the lower one: only the lower pays.
    within = 0.9 * capacity
    assert _round(None, within, load=LOAD, now=NOW, fill=0.9).paid == 0.0
    assert _round(None, within, load=0.8, now=NOW, fill=0.9).paid > 0.0


def test_the_room_a_lower_utilization_leaves_does_not_raise_the_trim() -> None:
    # A fill under LOW_FILL but above LOW_FILL x 0.8 / LOAD: room at the default's load,
    # what a replica kept at 80% shows.
    fill = (LOW_FILL + LOW_FILL * 0.8 / LOAD) / 2
    for load, trim in ((LOAD, 1.1), (0.8, 1.0)):
        first = _round(None, 9.0, load=load, now=NOW, fill=fill)
        later = _round(first, 9.0, load=load, now=NOW + 6, fill=fill)
        assert later.trim == pytest.approx(trim), load
    # Below the scaled bound it is room at either load.
    first = _round(None, 9.0, load=0.8, now=NOW, fill=0.4)
    assert _round(first, 9.0, load=0.8, now=NOW + 6, fill=0.4).trim == pytest.approx(1.1)


def test_the_compiled_route_reads_its_utilization() -> None:
    def paid(**overflow: float) -> float:
        return compiled_arrivals(PORTS, now=NOW, **overflow).paid

    # 32 slots / 4 s: a prior of 5.6/s against 6/s of demand.
    assert paid() == pytest.approx(1 - UTILIZATION * PRIOR_SHARE * 8.0 / 6.0, abs=1e-3)
    assert paid(utilization=0.5) == pytest.approx(1 - 0.5 * PRIOR_SHARE * 8.0 / 6.0, abs=1e-3)


def test_a_measured_capacity_keeps_the_trim_at_most_1() -> None:
    def at(previous: ArrivalsDecision | None, now: float, fill: float) -> ArrivalsDecision:
        return decide_arrivals(
            previous,
            demand=9.0,
            slots=32,
            running=min(1.0, fill),
            fill=fill,
            completions=4.4,
            service_time=4.0,
            now=now,
            load=0.8,
        )

    # On the prior, room with a share in force raises the trim above 1 ...
    prior = at(None, NOW, 0.4)
    raised = at(prior, NOW + 6, 0.4)
    assert not raised.measured and raised.trim == pytest.approx(1.1)
    # ... once measured at full batches it comes back to 1 at once ...
    full = at(raised, NOW + 7, 1.0)
    measured = at(full, NOW + 7 + SAMPLE_WINDOW, 1.0)
    assert measured.measured and measured.trim == 1.0
    assert measured.paid == pytest.approx(1 - 0.8 * 4.4 / 9.0, abs=0.01)
    # ... and room no longer raises it: the 0.8 asked for is what the replicas carry.
    roomy = at(measured, NOW + 30, 0.4)
    assert at(roomy, NOW + 40, 0.4).trim == 1.0 and "above 0.80 x capacity" in roomy.why
