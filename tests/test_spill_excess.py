"""Only the excess crosses: service times free of the replicas' queue wait, the drain term for
a lasting queue, and what status shows of a spill decision (pure: no Envoy, no etcd)."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from api.app import _spill
from compiler import compile_plan
from signals.spill import (
    DEADBAND,
    DRAIN_S,
    DWELL,
    FLOOR,
    LASTING,
    LOAD,
    QUEUE_SIGMAS,
    SETTLE,
    STEP,
    SpillDecision,
    decide_spill,
    queue_chance,
)
from signals.telemetry import TelemetryRecord
from tests.harness.regions import two_region_state
from tests.harness.upstreamlog import END, START, upstream_entry
from xdsserver.arrivals import PENDING_LIMIT, SERVICE_HOLD, SERVICE_WINDOW, ArrivalBook

HOST = "10.0.1.1:8000"


def _entry(
    kind: accesslog_pb2.AccessLogType.ValueType, request: int, **kwargs: Any
) -> accesslog_pb2.HTTPAccessLogEntry:
    """One entry of request number `request` (its start time says which)."""
    return upstream_entry(kind, start_us=1_700_000_000_000_000 + request, **kwargs)


def _book(slots: dict[str, int] | None) -> tuple[ArrivalBook, list[float]]:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0], slots=None if slots is None else lambda: slots)
    return book, clock


def _fill_host(book: ArrivalBook, count: int, **kwargs: Any) -> None:
    for request in range(count):
        book.observe(_entry(START, request, **kwargs), "us")


def test_an_attempt_that_waited_for_a_slot_gives_no_service_time() -> None:
    book, _ = _book({HOST: 2})
    _fill_host(book, 3)  # the third finds both slots taken: it queues in the replica
    assert book.in_flight() == {HOST: 3}
    assert (book.free_starts, book.queued_starts) == (2, 1)
    book.observe(_entry(END, 0, first=0.1, last=7.6), "us")
    book.observe(_entry(END, 1, first=0.1, last=7.6), "us")
    # First byte at once (headers before the queue) and its 5 s wait in the stream's time.
    book.observe(_entry(END, 2, first=0.1, last=12.5), "us")
    assert book.service_times() == {HOST: pytest.approx(7.5)}
    assert book.in_flight() == {}


def test_a_host_full_for_longer_than_the_window_keeps_its_last_service_time() -> None:
    """A locality held at capacity is full most of the time: its replicas' attempts start
    without a free slot and give no time, and its capacity must not go unknown then."""
    book, clock = _book({HOST: 1})
    book.observe(_entry(START, 0), "us")
    book.observe(_entry(END, 0, first=0.1, last=7.6), "us")
    assert book.service_times() == {HOST: pytest.approx(7.5)}
    # Full from now on: each start finds the slot taken by the one before.
    book.observe(_entry(START, 1), "us")
    for request in range(2, 22):
        clock[0] += 4.0
        book.observe(_entry(START, request), "us")
        # The first of them found the slot free (timed, 7.5 s); the rest waited 4.5 s each.
        book.observe(_entry(END, request - 1, first=0.1, last=7.6 if request == 2 else 12.1), "us")
        assert book.service_times() == {HOST: pytest.approx(7.5)}, clock[0] - 1000
    assert clock[0] - 1000 > SERVICE_WINDOW
    # Past the hold after the last time counted (request 1's end, 4 s in) with nothing new:
    # unknown, as for a host that stopped answering.
    clock[0] = 1004 + SERVICE_HOLD + 1
    assert book.service_times() == {}


def test_without_the_hosts_slots_every_streamed_answer_counts_as_before() -> None:
    book, _ = _book(None)
    _fill_host(book, 3)
    for request, last in ((0, 7.6), (1, 7.6), (2, 12.1)):
        book.observe(_entry(END, request, first=0.1, last=last), "us")
    assert book.service_times() == {HOST: pytest.approx(9.0)}
    # An end whose start was never seen counts too (a replica started before the log did).
    unseen, _ = _book({HOST: 2})
    unseen.observe(_entry(END, 7, first=0.1, last=9.1), "us")
    assert unseen.service_times() == {HOST: pytest.approx(9.0)}


def test_a_slot_frees_when_an_attempt_ends_whatever_its_answer() -> None:
    book, _ = _book({HOST: 1})
    book.observe(_entry(START, 0), "us")
    book.observe(_entry(END, 0, status=503), "us")  # failed: still out of the batch
    book.observe(_entry(START, 1), "us")  # finds the slot free
    book.observe(_entry(END, 1, first=0.1, last=5.1), "us")
    assert book.service_times() == {HOST: pytest.approx(5.0)}
    # A retry is a new attempt of the same request: its own start and end.
    book.observe(_entry(START, 2), "us")
    book.observe(_entry(START, 2, attempt=2), "us")
    assert book.in_flight() == {HOST: 2}
    book.observe(_entry(END, 2, attempt=1, status=503), "us")
    book.observe(_entry(END, 2, attempt=2, first=0.1, last=3.1), "us")
    assert book.in_flight() == {}
    # The retry started with the first attempt still in flight: no free slot, not timed.
    assert book.service_times() == {HOST: pytest.approx(5.0)}


def test_a_start_whose_end_never_comes_stops_counting_in_flight() -> None:
    book, clock = _book({HOST: 4})
    _fill_host(book, 3)
    clock[0] += PENDING_LIMIT + 1
    assert book.in_flight() == {}


def _ff(previous: SpillDecision | None, **kwargs: Any) -> SpillDecision:
    args: dict[str, Any] = {"local": 4, "fill": 0.9, "now": 100.0, "healthy": 1.0, "slots": 64}
    args.update(kwargs)
    return decide_spill(previous, **args)


def test_the_queue_a_poisson_load_has_by_chance_is_four_deviations_of_the_slots() -> None:
    assert queue_chance(64) == pytest.approx(32.0)  # 4 replicas of 16 slots
    assert queue_chance(16) == pytest.approx(QUEUE_SIGMAS * 4)
    assert queue_chance(0) == 0.0


def test_a_queue_beyond_chance_is_drained_on_top_of_the_excess() -> None:
    plain = _ff(None, arrivals=11.0, capacity=8.5, queued=20.0)
    assert plain.keep == pytest.approx(LOAD * 8.5 / 11.0, abs=1e-4)  # a chance queue
    assert plain.drain == 0.0
    deep = _ff(None, arrivals=11.0, capacity=8.5, queued=42.0, fill=1.6)
    # 10 requests over chance, drained in DRAIN_S: 2 a second less for the locality.
    drain = (42.0 - queue_chance(64)) / DRAIN_S
    assert deep.drain == pytest.approx(drain)
    assert deep.keep == pytest.approx((LOAD * 8.5 - drain) / 11.0, abs=1e-4)
    assert (deep.queued, deep.slots) == (42.0, 64)
    # Drained: the share goes back to the excess alone.
    after = _ff(deep, arrivals=11.0, capacity=8.5, queued=10.0, now=101.0)
    assert after.keep == pytest.approx(plain.keep, abs=1e-4)
    # Never below the floor, whatever the queue.
    assert _ff(None, arrivals=11.0, capacity=8.5, queued=500.0).keep == FLOOR


def test_with_the_queue_known_only_a_lasting_queue_moves_trim() -> None:
    over = _ff(None, arrivals=11.0, capacity=8.5, queued=40.0, fill=1.6)
    # Spilling for a dwell and still queueing: the drain term is at work, trim stands.
    later = _ff(over, arrivals=11.0, capacity=8.5, queued=40.0, fill=1.6, now=100.0 + DWELL)
    assert later.trim == 1.0
    lasting = _ff(later, arrivals=11.0, capacity=8.5, queued=40.0, fill=1.6, now=100.0 + LASTING)
    assert lasting.trim < 1.0
    # Without the queue, as before: a spill that still queues after a dwell corrects trim.
    blind = _ff(None, arrivals=11.0, capacity=8.5, fill=1.6, slots=None)
    blind = _ff(blind, arrivals=11.0, capacity=8.5, fill=1.6, slots=None, now=100.0 + DWELL)
    assert blind.trim < 1.0


def test_with_the_queue_known_only_lasting_room_raises_trim() -> None:
    over = _ff(None, arrivals=11.0, capacity=8.5, queued=0.0, fill=0.95)
    assert over.keep < 1.0 and over.trim == 1.0
    # The fill of a load at 97% of capacity dips under LOW_FILL for a few seconds by chance
    # (a lull in the arrivals): the estimate stands, however often it happens.
    decision, now = over, 100.0 + DWELL
    for fill in (0.75, 0.75, 0.9, 0.75, 0.75, 0.9) * 3:
        decision = _ff(decision, arrivals=11.0, capacity=8.5, queued=0.0, fill=fill, now=now)
        assert decision.trim == 1.0 and decision.keep == over.keep
        now += LASTING / 6
    # Room that lasts: the capacity is more than the estimate.
    start = now
    while now <= start + LASTING:
        decision = _ff(decision, arrivals=11.0, capacity=8.5, queued=0.0, fill=0.75, now=now)
        now += 1.0
    assert decision.trim == pytest.approx(1.0 + STEP)
    # Without the queue, as before: one round of room after a dwell raises it.
    blind = _ff(None, arrivals=11.0, capacity=8.5, fill=0.95, slots=None)
    blind = _ff(blind, arrivals=11.0, capacity=8.5, fill=0.75, slots=None, now=100.0 + DWELL)
    assert blind.trim == pytest.approx(1.0 + STEP)


def test_a_small_move_is_made_once_the_estimate_has_held_it() -> None:
    first = _ff(None, arrivals=11.0, capacity=8.5, queued=0.0)
    nudged = 11.0 * (1 + DEADBAND / 2)
    soon = _ff(first, arrivals=nudged, capacity=8.5, queued=0.0, now=100.0 + SETTLE / 2)
    assert soon.keep == first.keep  # within the deadband, not for long: noise
    held = _ff(soon, arrivals=nudged, capacity=8.5, queued=0.0, now=100.0 + SETTLE)
    assert held.keep == pytest.approx(LOAD * 8.5 / nudged, abs=1e-4) and held.since == 110.0
    # Without the queue known the deadband holds as before.
    old = _ff(None, arrivals=11.0, capacity=8.5, slots=None)
    old = _ff(old, arrivals=nudged, capacity=8.5, slots=None, now=100.0 + SETTLE)
    assert old.keep == first.keep


def test_status_shows_why_a_share_was_kept() -> None:
    # us: 2 replicas of 16 slots, 8 s a request: 4/s by the slots; they completed 4.5/s,
    # and 26 requests wait in them (queue_chance(32) = 22.6 by chance).
    telemetry = {
        f"10.0.1.{i}:8000": TelemetryRecord(at=99.5, running=16, waiting=13, max_running=16)
        for i in (1, 2)
    } | {  # eu has room for the spill
        f"10.0.2.{i}:8000": TelemetryRecord(at=99.5, running=10, waiting=0, max_running=16)
        for i in (1, 2)
    }
    times = {f"10.0.{r}.{i}:8000": 8.0 for r in (1, 2) for i in (1, 2)}
    state = two_region_state(
        telemetry,
        arrivals={"us/chat/chat": 5.0, "eu/chat/chat": 1.0},
        service_times=times,
        completions={"10.0.1.1:8000": 2.5, "10.0.1.2:8000": 2.0},
    )
    plan = compile_plan(state)
    (entry,) = [e for e in _spill(plan) if e["fleetRoute"] == "us/chat/chat"]
    drain = (26 - queue_chance(32)) / DRAIN_S
    assert entry["slotCapacity"] == pytest.approx(4.0)
    assert entry["completed"] == pytest.approx(4.5)
    assert entry["capacity"] == pytest.approx(4.5)
    assert entry["queued"] == 26
    assert entry["drain"] == pytest.approx(drain, abs=1e-4)
    # Both fleets' 6/s over the 8/s of the 64 slots: 0.75, far under us's own (5 / 4.5),
    # with room in eu: us levels with it rather than taking LOAD.
    assert entry["meanLoad"] == pytest.approx(0.75, abs=1e-4)
    assert entry["balancing"] and entry["level"] == entry["meanLoad"]
    assert entry["keep"] == pytest.approx((0.75 * 4.5 - drain) / 5.0, abs=1e-4)
    # eu's own 1/s is a quarter of its capacity: it keeps it all, and has no queue.
    (eu,) = [e for e in _spill(plan) if e["fleetRoute"] == "eu/chat/chat"]
    assert eu["keep"] == 1.0 and eu["drain"] == 0.0


def test_a_queue_within_chance_never_moves_trim_however_long_it_lasts() -> None:
    # 97% of capacity queues a little all the time: a batch fill over 1.05, 13 waiting.
    decision = _ff(None, arrivals=11.0, capacity=8.5, queued=13.0, fill=1.2)
    for step in range(1, 8):
        decision = _ff(
            decision, arrivals=11.0, capacity=8.5, queued=13.0, fill=1.2, now=100.0 + step * DWELL
        )
    assert decision.trim == 1.0
    assert decision.keep == pytest.approx(LOAD * 8.5 / 11.0, abs=1e-4)


def test_no_queue_is_drained_into_a_priority_that_cannot_take_it() -> None:
    for next_fill in (float("inf"), 1.3):  # nothing serves there, or it queues as well
        decision = _ff(None, arrivals=6.0, capacity=8.5, queued=60.0, next_fill=next_fill)
        assert decision.drain == 0.0 and decision.keep == 1.0
    assert _ff(None, arrivals=6.0, capacity=8.5, queued=60.0, next_fill=0.7).keep < 1.0
