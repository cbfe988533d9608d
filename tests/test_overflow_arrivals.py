"""Overflow driven by the route's arrival rate (``overflow.signal: arrivals``): the policy,
the route's demand from the arrivals log, and the decision (``signals.overflowff``)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from harness.builders import arrivals_overflow
from pydantic import ValidationError

from compiler.compile import PolicyState, compile_plan
from policies import parse_object
from policies.models import Overflow
from policies.models.overflow import UTILIZATION
from signals.overflow import OverflowDecision
from signals.overflowdemand import blend_demand, route_demand
from signals.overflowff import (
    PRIOR_SHARE,
    QUEUE_WAIT,
    ArrivalsDecision,
    decide_arrivals,
    drain_rate,
    kind_shares,
)
from signals.overflowwork import SAMPLE_WINDOW
from signals.spill import DEADBAND, DRAIN_S, LOAD
from signals.telemetry import TelemetryRecord
from xdsserver.arrivals import ARRIVAL_WINDOW, ArrivalBook

START = accesslog_pb2.AccessLogType.UpstreamPoolReady
END = accesslog_pb2.AccessLogType.UpstreamEnd

# --------------------------------------------------------------------------- the policy


def test_signal_defaults_to_arrivals_and_the_loop_is_named() -> None:
    assert Overflow.model_validate({"pools": ["paid"]}).signal == "arrivals"
    assert Overflow.model_validate({"pools": ["paid"], "signal": "fill"}).signal == "fill"
    # feedForward is the loop's: without the signal named, a clear error that says so.
    with pytest.raises(ValidationError, match="signal: fill"):
        Overflow.model_validate({"pools": ["paid"], "feedForward": 0.5})


def test_arrivals_with_feed_forward_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="feedForward"):
        Overflow.model_validate({"pools": ["paid"], "signal": "arrivals", "feedForward": 0.5})
    # feedForward 0 is its default: nothing to refuse.
    Overflow.model_validate({"pools": ["paid"], "signal": "arrivals", "feedForward": 0})


def test_an_unknown_signal_is_refused() -> None:
    with pytest.raises(ValidationError, match="signal"):
        Overflow.model_validate({"pools": ["paid"], "signal": "ttft"})


# --------------------------------------------------------------------------- the demand


def _entry(
    kind: int, cluster: str, *, attempt: int = 1, port: int = 8000
) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.access_log_type = kind
    common.upstream_cluster = cluster
    common.upstream_request_attempt_count = attempt
    common.upstream_remote_address.socket_address.address = "10.0.1.1"
    common.upstream_remote_address.socket_address.port_value = port
    entry.response.response_code.value = 200
    return entry


def test_the_route_demand_counts_every_pool_that_took_its_requests() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    for _ in range(8):  # 2 a second on the owned replicas, half of them conversations
        book.observe(_entry(START, "main/chat"), "edge")
        book.observe(_entry(START, "main/chat/affinity"), "edge")
        book.observe(_entry(START, "main/chat/overflow/paid"), "edge")  # 1 a second paid
        book.observe(_entry(START, "main/chat/overflow/paid", attempt=2), "edge")  # a retry
        book.observe(_entry(START, "main/other"), "edge")  # another route
        clock[0] += 0.5
    book.observe(_entry(START, "main/chat"), "core")  # another fleet's Envoys: counted too
    clock[0] += 0.5
    # Over the 4.5 s since the first start: (16 owned + 8 paid) / 4.5 by edge, and core's 1
    # over the same span (its first start is 0.5 s old: under MIN_SPAN, no rate yet).
    assert route_demand(book.rates(), "main/chat") == pytest.approx(24 / 4.5, rel=0.01)
    assert route_demand(book.rates(), "main/other") == pytest.approx(8 / 4.5, rel=0.01)
    # A prefix of another route's name is not it.
    assert route_demand(book.rates(), "main/ch") == 0.0
    # The spill's rates are what they were: one key per fleet and route cluster.
    assert set(book.rates()) == {
        "edge/main/chat",
        "edge/main/other",
        "edge/main/chat/overflow/paid",
    }
    assert book.session_rates() == {"edge/main/chat": pytest.approx(8 / 4.5, rel=0.01)}
    shares = book.session_shares()
    assert shares["main/chat"] == pytest.approx(0.5) and shares["main/other"] == 0.0
    clock[0] += ARRIVAL_WINDOW
    assert route_demand(book.rates(), "main/chat") == 0.0 and book.session_rates() == {}


def test_route_demand_adds_every_replica_and_fleet() -> None:
    rates = {
        "edge/main/chat": 2.0,
        "core/main/chat": 1.0,
        "edge/main/chat/overflow/paid": 0.5,
        "edge/main/chat/provider/paid": 0.25,
        "edge/main/chatty": 9.0,
    }
    assert route_demand(rates, "main/chat") == 3.75


def test_completions_over_a_shorter_window_see_only_the_last_seconds() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    for _ in range(20):  # 1 a second for 20 s, then 4 a second for 5 s
        book.observe(_entry(END, "main/chat"), "edge")
        clock[0] += 1.0
    for _ in range(20):
        book.observe(_entry(END, "main/chat"), "edge")
        clock[0] += 0.25
    host = "10.0.1.1:8000"
    assert book.completions(window=5.0)[host] == pytest.approx(4.0, rel=0.06)
    assert book.completions()[host] == pytest.approx(30 / ARRIVAL_WINDOW, rel=0.06)


# --------------------------------------------------------------------------- the decision

NOW = 10_000.0


def _round(
    previous: ArrivalsDecision | None,
    demand: float | None,
    *,
    now: float,
    running: float = 0.5,
    fill: float | None = 0.5,
    completions: float | None = None,
    slots: float = 32,
    service_time: float | None = 4.0,
    queued: float | None = None,
    objective: float | None = None,
    conversations: str = "last",
    session_share: float | None = None,
    recent: float | None = None,
) -> ArrivalsDecision:
    return decide_arrivals(
        previous,
        demand=demand,
        slots=slots,
        running=running,
        fill=fill,
        completions=completions,
        service_time=service_time,
        queued=queued,
        objective=objective,
        conversations=conversations,
        session_share=session_share,
        recent=recent,
        now=now,
        recover_interval=5.0,
    )


def test_before_a_saturated_period_the_prior_is_a_conservative_share_of_slots_over_time() -> None:
    # 32 slots, 4 s per request: 8/s at light load, 0.7 of it assumed.
    light = _round(None, 3.0, now=NOW)
    assert light.capacity == pytest.approx(PRIOR_SHARE * 8.0) and not light.measured
    assert light.paid == 0.0 and "within" in light.why
    peak = _round(light, 9.0, now=NOW + 1)
    assert peak.paid == pytest.approx(1 - LOAD * PRIOR_SHARE * 8.0 / 9.0, abs=1e-3)
    assert "above" in peak.why


def test_capacity_is_the_completion_rate_of_a_full_period_and_is_held_after_it() -> None:
    decision = _round(None, 9.0, now=NOW)
    # Full, but not for a sample window yet: the prior stays.
    decision = _round(decision, 9.0, now=NOW + 1, running=1.0, fill=1.0, completions=4.4)
    decision = _round(decision, 9.0, now=NOW + 3, running=1.0, fill=1.0, completions=4.4)
    assert not decision.measured
    decision = _round(
        decision, 9.0, now=NOW + 1 + SAMPLE_WINDOW, running=1.0, fill=1.0, completions=4.4
    )
    assert decision.measured and decision.capacity == pytest.approx(4.4)
    # The peak's capacity, not the light load's: the paid share follows it at once.
    assert decision.paid == pytest.approx(1 - LOAD * 4.4 / 9.0, abs=0.01)
    # A light period afterwards does not replace it (completions there are not capacity).
    later = _round(decision, 3.0, now=NOW + 60, running=0.4, fill=0.4, completions=3.0)
    assert later.capacity == pytest.approx(4.4) and later.measured
    # Half the replicas lost: half the slots, half the capacity, in the same round.
    assert _round(later, 3.0, now=NOW + 61, slots=16).capacity == pytest.approx(2.2)


def test_the_share_does_not_flap_on_noise_and_comes_back_when_demand_falls() -> None:
    decision = _round(None, 10.0, now=NOW, service_time=3.5)  # capacity 6.4/s (prior)
    first = decision.paid
    assert first > 0.3
    # A count a little off: held.
    noisy = _round(decision, 9.6, now=NOW + 1, service_time=3.5)
    assert noisy.paid == first and "hysteresis" in noisy.why
    # Demand falls under capacity: nothing moves before the recover interval ...
    fallen = _round(noisy, 4.0, now=NOW + 2, service_time=3.5)
    assert fallen.paid == first and fallen.next_at == pytest.approx(NOW + 5.0)
    # ... then all of it comes back at once.
    back = _round(fallen, 4.0, now=NOW + 5.0, service_time=3.5)
    assert back.paid == 0.0 and back.next_at == math.inf


def test_a_share_is_not_given_back_while_the_recent_rate_still_asks_for_it() -> None:
    # Capacity 5.6/s (prior). A rise to 8/s was taken from the recent rate ...
    # (A fill of 0.9 moves no trim.)
    risen = _round(None, 8.0, now=NOW, recent=8.0, fill=0.9)
    assert risen.paid == pytest.approx(1 - LOAD * PRIOR_SHARE * 8.0 / 8.0, abs=1e-3)
    # ... and the long window, still half the rate from before the rise, reads within
    # capacity: the last seconds' 8/s hold the share.
    lagging = _round(risen, 5.0, now=NOW + 6, recent=8.0, fill=0.9)
    assert lagging.target == 0.0 and lagging.paid == risen.paid
    assert "the last seconds' 8.00/s" in lagging.why
    # Both agree the demand fell: it comes back.
    assert _round(lagging, 5.0, now=NOW + 7, recent=4.0, fill=0.9).paid == 0.0
    # Only part of the way: the share falls to what the recent rate asks for.
    partial = _round(risen, 5.0, now=NOW + 6, recent=7.0, fill=0.9)
    assert partial.paid == pytest.approx(1 - LOAD * PRIOR_SHARE * 8.0 / 7.0, abs=1e-3)


def test_a_rise_is_taken_at_once_whatever_the_last_change() -> None:
    decision = _round(None, 8.0, now=NOW)
    higher = _round(decision, 14.0, now=NOW + 0.5)
    assert higher.paid > decision.paid + DEADBAND


def test_without_telemetry_arrivals_or_capacity_nothing_goes_to_paid() -> None:
    assert _round(None, 9.0, now=NOW, fill=None).why == "no fresh telemetry"
    assert _round(None, None, now=NOW).why == "no arrivals reported"
    nothing = _round(None, 9.0, now=NOW, service_time=None)
    assert nothing.paid == 0.0 and nothing.why == "no capacity estimate yet"


def test_a_queue_that_lasts_with_a_share_in_force_trims_the_estimate() -> None:
    decision = _round(None, 9.0, now=NOW)  # prior 5.6/s: 40% paid
    assert decision.paid > 0
    still = _round(decision, 9.0, now=NOW + 2, fill=1.5)
    assert still.trim == 1.0  # within the dwell: the queue formed before the share
    cut = _round(still, 9.0, now=NOW + 6, fill=1.5)
    assert cut.trim == pytest.approx(max(0.85, 0.95 / 1.5)) and cut.paid > decision.paid
    # Room to spare with a share in force: the trim rises back, a dwell later.
    eased = _round(cut, 9.0, now=NOW + 12, fill=0.6)
    assert eased.trim == pytest.approx(cut.trim + 0.1)


def test_the_queue_beyond_the_objective_is_drained_over_the_drain_time() -> None:
    # 5/s capacity, a 1 s objective: a request may wait 0.5 s, so 2.5 may wait.
    assert drain_rate(2.0, 5.0, 1.0) == (0.0, 2.5)
    assert drain_rate(12.5, 5.0, 1.0) == (pytest.approx(10.0 / DRAIN_S), 2.5)
    # No objective, no queue reported: nothing drained.
    assert drain_rate(50.0, 5.0, None) == (0.0, math.inf)
    assert drain_rate(None, 5.0, 1.0) == (0.0, math.inf)


def test_a_queue_left_by_the_peak_goes_to_paid_until_it_is_served() -> None:
    # Demand within capacity (prior 5.6/s): no excess, but 22.8 waiting, 20 beyond the
    # 2.8 a 1 s objective allows (5.6/s x 0.5 s): 4/s more to the paid pools.
    calm = _round(None, 5.0, now=NOW, fill=1.6, objective=1.0, session_share=0.5)
    assert calm.paid == 0.0
    queued = _round(calm, 5.0, now=NOW + 1, fill=1.6, queued=22.8, objective=1.0)
    capacity = PRIOR_SHARE * 8.0
    allowed = capacity * 1.0 * QUEUE_WAIT
    drain = (22.8 - allowed) / DRAIN_S
    assert queued.drain == pytest.approx(5.0 * queued.paid, abs=1e-3)
    assert queued.paid == pytest.approx(min(0.5, 1 - (LOAD * capacity - drain) / 5.0), abs=1e-3)
    assert queued.paid > 0.3 and "to drain it" in queued.why and "within" in queued.why
    # The same queue without an objective: nothing drained.
    assert _round(calm, 5.0, now=NOW + 1, fill=1.6, queued=22.8).paid == 0.0
    # Served: the share comes back after the recover interval.
    served = _round(queued, 5.0, now=NOW + 7, fill=0.8, queued=1.0, objective=1.0)
    assert served.paid == 0.0 and served.drain == 0.0


def test_the_drain_takes_conversations_only_when_they_overflow_with_the_rest() -> None:
    # 40% of the demand has no session: with conversations last, a drain that would need
    # 60% of the demand stops at 40%; with conversations: with it takes what it needs.
    learned = _round(None, 5.0, now=NOW, session_share=0.6)
    assert learned.plain_share == pytest.approx(0.4)
    last = _round(learned, 5.0, now=NOW + 1, fill=2.0, queued=40.0, objective=1.0)
    assert last.paid == pytest.approx(0.4)
    both = _round(
        learned, 5.0, now=NOW + 1, fill=2.0, queued=40.0, objective=1.0, conversations="with"
    )
    assert both.paid > 0.6
    # Demand above capacity already overflows conversations: the drain adds nothing there
    # under conversations last, and never lowers the excess's own share.
    excess = _round(learned, 12.0, now=NOW + 1, fill=2.0, queued=40.0, objective=1.0)
    assert excess.paid == pytest.approx(1 - LOAD * PRIOR_SHARE * 8.0 / 12.0, abs=1e-3)


def test_room_made_by_a_drain_or_a_held_share_does_not_raise_the_trim() -> None:
    # 40% paid from the excess (capacity 5.6/s prior, 9/s), then the demand falls within
    # capacity: the share is held for the recover interval and the batches empty. That room
    # is the held share's, not capacity the estimate missed.
    decision = _round(None, 9.0, now=NOW, fill=0.9)
    held = _round(decision, 4.0, now=NOW + 3, fill=0.5)
    assert held.paid == decision.paid and held.target == 0.0
    # At the recover interval the share comes back, and the trim stays where it was.
    fallen = _round(held, 4.0, now=NOW + 5, fill=0.5)
    assert fallen.paid == 0.0 and fallen.trim == 1.0
    # A drain: the queue is sent to paid and the batches have room a dwell later.
    calm = _round(None, 5.0, now=NOW, fill=0.9, session_share=0.5)
    drained = _round(calm, 5.0, now=NOW + 1, fill=1.6, queued=22.8, objective=1.0)
    assert drained.drain > 0
    after = _round(drained, 5.0, now=NOW + 7, fill=0.5, queued=0.0, objective=1.0)
    assert after.trim == 1.0
    # The estimate's own share with room to spare still raises it.
    own = _round(decision, 9.0, now=NOW + 6, fill=0.5)
    assert own.trim == pytest.approx(1.1)


def test_plain_requests_take_the_share_first() -> None:
    assert kind_shares(0.2, 0.4, "last") == (0.5, 0.0)
    assert kind_shares(0.55, 0.4, "last") == (1.0, 0.25)
    assert kind_shares(0.3, 0.4, "with") == (0.3, 0.3)
    assert kind_shares(0.25, None, "last") == (0.5, 0.0)  # before any is seen: half plain


def test_the_plain_share_is_learned_while_nothing_overflows() -> None:
    learned = decide_arrivals(
        None,
        demand=3.0,
        slots=32,
        running=0.5,
        fill=0.5,
        completions=None,
        service_time=4.0,
        session_share=0.6,
        now=NOW,
    )
    assert learned.plain_share == pytest.approx(0.4)
    overflowing = decide_arrivals(
        replace(learned, paid=0.3),
        demand=9.0,
        slots=32,
        running=1.0,
        fill=1.0,
        completions=None,
        service_time=4.0,
        session_share=0.9,  # the plain ones went to paid: not a new share
        now=NOW + 1,
    )
    assert overflowing.plain_share == pytest.approx(0.4)


# --------------------------------------------------------------------------- the compile

PORTS = (8001, 8002, 8003, 8004)


def _state(
    demand: float, *, running: float, previous: OverflowDecision | None = None, now: float = NOW
) -> PolicyState:
    objects = [parse_object(body) for body in arrivals_overflow(PORTS)]
    hosts = [f"127.0.0.1:{port}" for port in PORTS]
    return PolicyState.from_objects(
        objects,
        telemetry={
            "owned": {
                host: TelemetryRecord(at=now - 1, running=8 * running, max_running=8)
                for host in hosts
            }
        },
        now=now,
        # Two fleets' Envoys, some of the requests already on the paid pool's aggregate.
        arrivals={
            "default/main/chat": demand * 0.6,
            "edge/main/chat": demand * 0.2,
            "default/main/chat/overflow/paid": demand * 0.2,
        },
        service_times={host: 4.0 for host in hosts},  # 32 slots / 4 s: prior 0.7 x 8/s
        session_shares={"main/chat": 0.6},
        previous_overflow={"main/chat": previous} if previous is not None else {},
    )


def test_the_compiled_route_overflows_the_demand_above_capacity_plain_requests_first() -> None:
    light = compile_plan(_state(3.0, running=0.4)).overflow["main/chat"]
    assert light.signal == "arrivals" and light.arrivals is not None
    assert light.arrivals.demand == pytest.approx(3.0)
    assert light.plain == light.sessions == 0.0
    assert light.arrivals.plain_share == pytest.approx(0.4)  # learned: nothing overflowed
    peak = compile_plan(_state(12.0, running=1.0, previous=light, now=NOW + 1))
    decision = peak.overflow["main/chat"]
    paid = 1 - UTILIZATION * PRIOR_SHARE * 8.0 / 12.0
    assert decision.arrivals is not None and decision.arrivals.paid == pytest.approx(paid, abs=1e-3)
    # 40% of the demand has no session: those go first, all of them and some conversations.
    assert decision.plain == 1.0
    assert decision.sessions == pytest.approx((paid - 0.4) / 0.6, abs=1e-3)
    assert decision.provider == "paid"
    # The route entries carry it (Envoy draws per request).
    listener = peak.fleets[0].listeners[0]
    assert listener.arrivals_log
    route = listener.virtual_hosts[0].routes[0]
    assert route.overflow is not None and route.overflow.arrivals
    assert route.overflow.plain == 1.0


def test_a_rise_of_demand_shows_in_the_recent_rate_within_seconds() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    for _ in range(20):  # 1 a second for 20 s
        book.observe(_entry(START, "main/chat"), "edge")
        book.observe(
            _entry(START, "main/chat/overflow/paid"),
            "edge",
        )
        clock[0] += 1.0
    # Then 6 a second for 4 s (4 on the owned replicas, 2 on the paid pool).
    clock[0] += 0.25
    for _ in range(8):
        for _ in range(2):
            book.observe(_entry(START, "main/chat"), "edge")
        book.observe(_entry(START, "main/chat/overflow/paid"), "edge")
        clock[0] += 0.5
    clock[0] -= 0.25
    assert book.recent_demands() == {"main/chat": pytest.approx(6.0)}
    # The rates follow the route's rise beyond noise from its change point, found on its
    # clusters' starts together: the owned replicas' 1 to 4 a second and the paid pool's 1
    # to 2 (alone within the noise of 8 starts) both count from it.
    rates = book.rates()
    assert rates["edge/main/chat"] == pytest.approx(4.0)
    assert rates["edge/main/chat/overflow/paid"] == pytest.approx(2.0)
    assert route_demand(rates, "main/chat") == pytest.approx(6.0)


def test_a_route_s_demand_holds_while_overflow_moves_its_split() -> None:
    # 6 a second for 20 s on the owned replicas; then the same 6 a second, half of them to a
    # paid pool the route had not used: the owned cluster's rate falls beyond noise, the
    # paid pool's cluster is new. The route's demand stays 6 a second at every round, the
    # new cluster counting from its first start.
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    for _ in range(120):
        book.observe(_entry(START, "main/chat"), "edge")
        clock[0] += 1 / 6
    demands = []
    for tick in range(60):  # 10 s, the split moved
        name = "main/chat" if tick % 2 else "main/chat/overflow/paid"
        book.observe(_entry(START, name), "edge")
        clock[0] += 1 / 6
        if tick % 6 == 5:
            demands.append(route_demand(book.rates(), "main/chat"))
    assert demands == [pytest.approx(6.0, rel=0.05)] * len(demands)
    rates = book.rates()
    assert rates["edge/main/chat/overflow/paid"] > 0 and rates["edge/main/chat"] < 6.0


def test_the_recent_rate_counts_only_when_it_rises_beyond_noise() -> None:
    assert blend_demand(4.0, None) == 4.0
    assert blend_demand(4.0, 3.0) == 4.0  # a fall waits for the long window
    assert blend_demand(4.0, 5.0) == 4.0  # 20 starts where 16 were expected: noise
    assert blend_demand(4.0, 7.0) == 7.0  # 28 where 16 were: a rise


def test_what_the_replicas_completed_bounds_the_capacity_from_below() -> None:
    decision = decide_arrivals(
        None,
        demand=6.0,
        slots=32,
        running=0.8,
        fill=0.8,
        completions=None,
        service_time=4.0,  # prior 5.6/s
        completed=5.9,  # but they served 5.9/s without being full
        now=NOW,
    )
    assert decision.capacity == pytest.approx(5.9) and not decision.measured
    assert decision.paid == 0.0  # 6.0 against 0.97 x 5.9: within the dead band
