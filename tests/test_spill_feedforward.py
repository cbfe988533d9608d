"""Spill feed-forward: the arrivals signal read from Envoy's upstream log, the capacity of a
locality, and the share that follows them at once with the fill loop's correction."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from compiler import compile_plan
from compiler.locality import capacity
from compiler.plan import PlanEndpoint
from controlplane.local import find_binary
from policies import Fleet
from signals import PolicyState
from signals.spill import (
    DEADBAND,
    DWELL,
    FLOOR,
    LASTING,
    LOAD,
    STEP,
    SpillDecision,
    decide_spill,
)
from signals.telemetry import TelemetryRecord
from tests.harness.golden import load_case
from tests.harness.regions import two_region_state
from tests.harness.upstreamlog import END, START, upstream_entry
from xdsserver.arrivals import (
    ARRIVAL_WINDOW,
    CHANGE_WINDOW,
    MIN_SPAN,
    SERVICE_HOLD,
    ArrivalBook,
)
from xdsserver.signals import SignalBook
from xdsserver.static import validate_with_envoy
from xdsserver.translate import translate
from xdsserver.translate.listeners import ARRIVALS_LOG, translate_listener


def _ff(previous: SpillDecision | None, **kwargs: Any) -> SpillDecision:
    args: dict[str, Any] = {"local": 4, "fill": 0.9, "now": 100.0, "healthy": 1.0}
    args.update(kwargs)
    return decide_spill(previous, **args)


@pytest.mark.parametrize(
    ("arrivals", "cap", "keep"),
    [
        (6.0, 8.5, 1.0),  # under capacity: everything stays
        (11.0, 8.5, round(LOAD * 8.5 / 11.0, 4)),  # over: only the excess crosses
        (100.0, 8.5, FLOOR),  # far over: the floor holds
    ],
)
def test_the_share_is_the_capacity_over_the_arrivals_at_once(
    arrivals: float, cap: float, keep: float
) -> None:
    decision = _ff(None, arrivals=arrivals, capacity=cap)
    assert decision.keep == pytest.approx(keep)
    assert decision.feed_forward


def test_small_moves_are_left_out_and_large_ones_are_not() -> None:
    first = _ff(None, arrivals=11.0, capacity=8.5)
    nudged = _ff(first, arrivals=11.0 * (1 + DEADBAND / 2), capacity=8.5, now=100.5)
    assert (nudged.keep, nudged.since) == (first.keep, first.since)
    surge = _ff(first, arrivals=14.0, capacity=8.5, now=100.5)
    assert surge.keep == pytest.approx(LOAD * 8.5 / 14.0, abs=1e-4) and surge.since == 100.5
    calm = _ff(surge, arrivals=5.0, capacity=8.5, now=101.0)
    assert calm.keep == 1.0


def test_a_locality_that_loses_replicas_spills_their_capacity_in_the_same_round() -> None:
    before = _ff(None, arrivals=3.8, capacity=8.5)
    assert before.keep == 1.0 and before.overprovisioning == 140
    # Two of four replicas die (unhealthy): half the capacity, half of priority 0 healthy.
    wave = _ff(before, local=2, arrivals=3.8, capacity=2.0, healthy=0.5, now=100.1)
    assert wave.keep == pytest.approx(LOAD * 2.0 / 3.8, abs=1e-4)
    # Envoy gives priority 0 healthy x factor: the factor makes up for the dead half.
    assert wave.overprovisioning == round(100 * wave.keep / 0.5)
    # Never above Envoy's own factor: health spill still bounds what stays.
    room = _ff(before, local=2, arrivals=3.8, capacity=4.0, healthy=0.5, now=100.1)
    assert room.keep == pytest.approx(1.0) and room.overprovisioning == 140


def test_a_draining_replica_is_left_out_of_the_healthy_share_as_envoy_leaves_it_out() -> None:
    """Envoy excludes an EDS DRAINING host from its priority's health: us, one replica
    serving and one draining, is a fully healthy priority 0 of one replica to Envoy, so the
    factor is 100 x keep (counted as half healthy, it was twice that: nothing spilled)."""
    telemetry = {
        "10.0.1.1:8000": TelemetryRecord(at=99.5, running=16, waiting=0, max_running=16),
        "10.0.1.2:8000": TelemetryRecord(at=99.5, running=8, waiting=0, max_running=16),
    } | {
        f"10.0.2.{i}:8000": TelemetryRecord(at=99.5, running=4, waiting=0, max_running=16)
        for i in (1, 2)
    }
    state = two_region_state(
        telemetry,
        # eu's own fleet keeps its region busy: the cluster's mean load is over us's capacity
        # too, so us is given LOAD of it (it does not level with an idle region).
        arrivals={"us/chat/chat": 3.0, "eu/chat/chat": 5.0},
        service_times={key: 8.0 for key in telemetry},
        draining=("10.0.1.2",),
    )
    decision = compile_plan(state).spill["us/chat/chat"]
    # The serving replica's 16 slots over 8 s: 2 requests/s for 3 arriving.
    assert decision.keep == pytest.approx(LOAD * 2.0 / 3.0, abs=1e-4)
    assert decision.healthy == 1.0
    assert decision.overprovisioning == round(100 * decision.keep)


def test_the_fill_loop_trims_the_estimate_after_the_dwell() -> None:
    first = _ff(None, arrivals=11.0, capacity=8.5, fill=1.0)
    assert first.trim == 1.0
    # The estimate was too high: the replicas still queue. Within the dwell, nothing.
    early = _ff(first, arrivals=11.0, capacity=8.5, fill=1.3, now=100.0 + DWELL / 2)
    assert early.trim == 1.0 and early.keep == first.keep
    later = _ff(early, arrivals=11.0, capacity=8.5, fill=1.3, now=100.0 + DWELL)
    assert later.trim < 1.0 and later.keep < first.keep
    # Room again: the correction comes back by steps.
    room = _ff(later, arrivals=11.0, capacity=8.5, fill=0.5, now=100.0 + 2 * DWELL)
    assert room.trim == pytest.approx(later.trim + STEP)


def test_a_ramp_goes_on_when_feed_forward_comes_back_in_the_middle_of_it() -> None:
    gone = decide_spill(SpillDecision(keep=1.0, local=4), local=0, fill=None, now=0.0)
    back = decide_spill(gone, local=4, fill=0.3, now=1.0)  # no arrivals yet: fill alone
    step = decide_spill(back, local=4, fill=0.3, now=1.0 + DWELL)
    assert step.keep == FLOOR + STEP and step.ramp
    # Arrivals again: the capacity would take all of it, but the ramp goes on by steps.
    resumed = _ff(step, arrivals=6.0, capacity=8.5, fill=0.3, now=2.0 + DWELL)
    assert resumed.keep == step.keep
    later = _ff(resumed, arrivals=6.0, capacity=8.5, fill=0.3, now=1.0 + 2 * DWELL)
    assert later.keep == pytest.approx(FLOOR + 2 * STEP)


def test_under_capacity_only_a_lasting_queue_corrects_the_estimate() -> None:
    calm = _ff(None, arrivals=6.0, capacity=8.5, fill=0.7)
    burst = _ff(calm, arrivals=6.0, capacity=8.5, fill=1.3, now=110.0)
    assert burst.trim == 1.0 and burst.keep == 1.0  # a burst: the estimate stands
    still = _ff(burst, arrivals=6.0, capacity=8.5, fill=1.3, now=110.0 + DWELL)
    assert still.trim == 1.0
    lasting = _ff(still, arrivals=6.0, capacity=8.5, fill=1.3, now=110.0 + LASTING)
    assert lasting.trim < 1.0  # still queueing long after: the estimate was too high
    over = _ff(None, arrivals=11.0, capacity=8.5, fill=1.3)
    assert over.trim == 1.0 and over.keep < 1.0  # the spill starts: its queue came before it
    still = _ff(over, arrivals=11.0, capacity=8.5, fill=1.3, now=100.0 + DWELL)
    assert still.trim < 1.0  # spilling for a dwell and still queueing: the fill corrects


def test_nothing_is_cut_towards_a_next_priority_without_serving_replicas() -> None:
    down = _ff(None, arrivals=11.0, capacity=8.5, fill=1.3, next_fill=float("inf"))
    assert down.trim == 1.0


def test_without_arrivals_the_fill_loop_alone_decides() -> None:
    assert _ff(None, fill=1.1).keep == pytest.approx(0.95 / 1.1, abs=1e-4)
    assert not _ff(None, fill=1.1).feed_forward


def test_a_region_back_from_an_outage_ramps_under_feed_forward_too() -> None:
    gone = decide_spill(SpillDecision(keep=1.0, local=4), local=0, fill=None, now=0.0)
    back = _ff(gone, arrivals=6.0, capacity=8.5, now=1.0)
    assert back.keep == FLOOR
    now, shares = 1.0, []
    decision = back
    while decision.keep < 1.0:
        decision = _ff(decision, arrivals=6.0, capacity=8.5, fill=0.3, now=now)
        shares.append(decision.keep)
        now += DWELL
    assert shares[0] == FLOOR and shares == sorted(shares) and len(set(shares)) >= 5


def _endpoint(i: int) -> PlanEndpoint:
    return PlanEndpoint("llama", f"10.0.1.{i}", 8000, 100, 0, region="us")


def _located(*, signal: str = "arrivals", **live: Any) -> PolicyState:
    """Every replica running 12 of its 16 slots; the fleets' spillSignal is ``signal``."""
    now = 100.0
    telemetry = {
        f"10.0.{r}.{i}:8000": TelemetryRecord(at=now - 0.5, running=12, max_running=16)
        for r in (1, 2)
        for i in (1, 2)
    }
    return two_region_state(telemetry, now=now, spill_signal=signal, **live)


def test_capacity_is_the_slots_over_the_service_time() -> None:
    state = _located(service_times={"10.0.1.1:8000": 8.0})
    # 16 slots each; the second replica takes the first one's time: 32 / 8 s.
    assert capacity([_endpoint(1), _endpoint(2)], state) == pytest.approx(4.0)
    assert capacity([_endpoint(1)], _located()) is None  # no time measured
    # Completing more than the byte timings allow: the completion rate is the capacity.
    busy = replace(state, completions={"10.0.1.1:8000": 3.0, "10.0.1.2:8000": 2.5})
    assert capacity([_endpoint(1), _endpoint(2)], busy) == pytest.approx(5.5)
    stale = replace(state, now=200.0)
    assert capacity([_endpoint(1), _endpoint(2)], stale) is None  # no fresh batch size


def test_the_compiled_fleet_spills_its_excess_and_logs_its_arrivals() -> None:
    times = {f"10.0.{r}.{i}:8000": 8.0 for r in (1, 2) for i in (1, 2)}
    # us: 32 slots / 8 s = 4 requests a second; its Envoys start 5. eu's start 3: the two
    # together are the cluster's capacity, and only us's excess can go.
    arrivals = {"us/chat/chat": 5.0, "eu/chat/chat": 3.0}
    plan = compile_plan(_located(arrivals=arrivals, service_times=times))
    assert plan.spill["us/chat/chat"].keep == pytest.approx(LOAD * 4 / 5)
    assert plan.spill["eu/chat/chat"].keep == 1.0
    assert plan.spill["us/chat/chat"].mean_load == pytest.approx(1.0)
    assert plan.fleet("us").clusters[0].overprovisioning == round(100 * LOAD * 4 / 5)
    assert all(plan.fleet(f).listeners[0].arrivals_log for f in ("us", "eu"))
    # spillSignal: fill: no log, and arrivals are not read.
    plan = compile_plan(_located(arrivals=arrivals, service_times=times, signal="fill"))
    assert not plan.spill["us/chat/chat"].feed_forward
    assert not plan.fleet("us").listeners[0].arrivals_log


def test_a_bad_spill_signal_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="spillSignal"):
        Fleet.model_validate(
            {"kind": "Fleet", "metadata": {"name": "us"}, "spec": {"spillSignal": "guess"}}
        )


def test_the_arrival_book_counts_first_attempts_over_its_window() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    for _ in range(10):
        book.observe(upstream_entry(START), "us")
        clock[0] += 0.5
    book.observe(upstream_entry(START, attempt=2), "us")  # a retry: not new demand
    book.observe(upstream_entry(START, cluster=""), "us")  # a local reply: no cluster
    # Ten starts over the five seconds since the first.
    assert book.rates() == {"us/chat/chat": pytest.approx(2.0)}
    clock[0] += ARRIVAL_WINDOW
    assert book.rates() == {}


def test_a_change_of_rate_shows_within_the_short_window() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    book.observe(upstream_entry(START), "us")
    clock[0] += MIN_SPAN / 2
    assert book.rates() == {}  # too soon to say
    for _ in range(int(ARRIVAL_WINDOW * 5)):  # 5 a second
        book.observe(upstream_entry(START), "us")
        clock[0] += 0.2
    assert book.rates()["us/chat/chat"] == pytest.approx(5.0, rel=0.05)
    for _ in range(int(CHANGE_WINDOW * 15)):  # then 15 a second: an overload begins
        book.observe(upstream_entry(START), "us")
        clock[0] += 1 / 15
    assert book.rates()["us/chat/chat"] == pytest.approx(15.0, rel=0.05)


def test_the_arrival_book_times_streamed_answers_from_first_to_last_byte() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    book.observe(upstream_entry(END, first=2.0, last=9.5), "us")  # 2 s queued in the replica
    book.observe(upstream_entry(END, first=0.1, last=7.6), "us")
    book.observe(upstream_entry(END, first=0.1, last=0.1), "us")  # not streamed: says nothing
    book.observe(upstream_entry(END, first=0.1, last=9.0, status=503), "us")
    book.observe(upstream_entry(END), "us")  # no bytes back
    assert book.service_times() == {"10.0.1.1:8000": pytest.approx(7.5)}
    clock[0] += MIN_SPAN
    # Every 200 counts as a completion, streamed or not: four over the two seconds.
    assert book.completions() == {"10.0.1.1:8000": pytest.approx(4 / MIN_SPAN)}
    clock[0] += 60
    assert book.completions() == {}
    # The last service time stands a while (a full host gives none), then goes.
    assert book.service_times() == {"10.0.1.1:8000": pytest.approx(7.5)}
    clock[0] += SERVICE_HOLD
    assert book.service_times() == {}


def test_rollout_signals_skip_the_start_entries() -> None:
    book = SignalBook(lambda cluster, address, port: "llama")
    book.observe(upstream_entry(START), "us")
    assert not book.counters
    book.observe(upstream_entry(END, first=0.1, last=1.0), "us")
    assert book.counters["chat/chat"]["llama"].requests == 1


def test_a_listener_with_rollout_signals_and_arrivals_passes_envoy_validation(
    tmp_path: Path,
) -> None:
    plan = compile_plan(load_case("regions-locality").state())
    fleet = next(f for f in plan.fleets if f.listeners and f.listeners[0].arrivals_log)
    listener = replace(fleet.listeners[0], upstream_signals=True)
    assert listener.arrivals_log
    router = translate_listener(listener).filter_chains[0]
    assert ARRIVALS_LOG.encode() in router.SerializeToString()
    fleet = replace(fleet, listeners=(listener,))
    ok, output = validate_with_envoy(translate(fleet), find_binary("envoy"), tmp_path)
    assert ok, output
