"""The arrival rate after a change: counted since the change point, over a span that grows
from ``CHANGE_WINDOW`` to the long window as the evidence grows (pure)."""

from __future__ import annotations

import random

import pytest

from tests.harness.upstreamlog import START, upstream_entry
from xdsserver.arrivals import (
    ARRIVAL_WINDOW,
    CHANGE_WINDOW,
    ArrivalBook,
    change_point_rate,
)


def _even(rate: float, start: float, end: float) -> list[float]:
    """Starts at `rate` a second, evenly spaced, in (start, end) (half a gap off each end)."""
    count = round((end - start) * rate)
    return [start + (index + 0.5) / rate for index in range(count)]


def _rate(
    starts: list[float], now: float, change: float | None = None
) -> tuple[float, float | None]:
    window = [at for at in starts if at > now - ARRIVAL_WINDOW]
    return change_point_rate(window, now, now - ARRIVAL_WINDOW, change)


def test_a_steady_rate_is_the_long_window_s() -> None:
    starts = _even(10.0, 0.0, 40.0)
    rate, change = _rate(starts, 40.0)
    assert rate == pytest.approx(10.0, rel=0.01) and change is None


def test_a_rise_is_counted_from_its_change_point() -> None:
    starts = _even(5.0, 0.0, 30.0) + _even(15.0, 30.0, 34.0)
    rate, change = _rate(starts, 34.0)
    assert change == pytest.approx(34.0 - CHANGE_WINDOW)
    assert rate == pytest.approx(15.0, rel=0.01)  # the long window says 7.5


def test_after_the_change_the_span_grows_and_the_old_rate_stays_out() -> None:
    starts = _even(5.0, 0.0, 30.0) + _even(15.0, 30.0, 42.0)
    # Eight seconds after the change was found, its rate is over the twelve since the
    # change point: the sixteen-second window would mix in four seconds at 5 (12.5).
    rate, change = _rate(starts, 42.0, change=30.0)
    assert change == 30.0
    assert rate == pytest.approx(15.0, rel=0.01)
    # Once the long window holds only what followed the change, the change point goes.
    rate, change = _rate(starts + _even(15.0, 42.0, 47.0), 47.0, change=30.0)
    assert change is None and rate == pytest.approx(15.0, rel=0.01)


def test_a_fall_after_a_change_is_a_new_change_point() -> None:
    starts = _even(5.0, 0.0, 30.0) + _even(15.0, 30.0, 40.0) + _even(5.0, 40.0, 44.0)
    rate, change = _rate(starts, 44.0, change=30.0)
    assert change == pytest.approx(40.0)
    assert rate == pytest.approx(5.0, rel=0.01)


def test_right_after_a_change_point_there_is_nothing_to_compare_with() -> None:
    starts = _even(5.0, 0.0, 30.0) + _even(15.0, 30.0, 35.0)
    # One second after the change point: the rate since it, no new change point.
    rate, change = _rate(starts, 35.0, change=34.0)
    assert change == 34.0 and rate == pytest.approx(15.0, rel=0.01)


def test_poisson_noise_rarely_makes_a_change() -> None:
    """A steady 10 a second for 20 minutes, read every half second: few change points, and
    the rate's spread stays near the long window's."""
    rng = random.Random(7)
    starts, at = [], 0.0
    while at < 1200.0:
        at += rng.expovariate(10.0)
        starts.append(at)
    changes, errors, change = 0, [], None
    now = ARRIVAL_WINDOW
    while now < 1200.0:
        window = [s for s in starts if now - ARRIVAL_WINDOW < s <= now]
        rate, found = change_point_rate(window, now, now - ARRIVAL_WINDOW, change)
        changes += found is not None and found != change
        change = found
        errors.append(rate / 10.0 - 1.0)
        now += 0.5
    assert changes <= 8
    spread = (sum(e * e for e in errors) / len(errors)) ** 0.5
    assert spread < 0.1  # the long window alone: 0.079


def test_the_book_follows_a_rise_with_the_rate_since_it() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])

    def send(rate: float, seconds: float) -> None:
        for _ in range(round(rate * seconds)):
            book.observe(upstream_entry(START), "us")
            clock[0] += 1.0 / rate

    send(5.0, 2 * ARRIVAL_WINDOW)
    assert book.rates()["us/chat/chat"] == pytest.approx(5.0, rel=0.05)
    send(15.0, CHANGE_WINDOW)
    assert book.rates()["us/chat/chat"] == pytest.approx(15.0, rel=0.05)
    send(15.0, CHANGE_WINDOW)  # 8 s in, the long window would say 10
    assert book.rates()["us/chat/chat"] == pytest.approx(15.0, rel=0.05)
    send(15.0, ARRIVAL_WINDOW)
    assert book.rates()["us/chat/chat"] == pytest.approx(15.0, rel=0.05)
