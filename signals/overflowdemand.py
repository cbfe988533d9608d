"""A route's demand for overflow by arrivals (pure, no I/O): the requests per second its
fleets' Envoys started on its own cluster and on its overflow aggregates and paid pools
(``xdsserver.arrivals``), and the long rate blended with the recent one
(``signals.overflowff`` decides the paid share from it)."""

from __future__ import annotations

import math
from collections.abc import Mapping

OVERFLOW_PARTS = ("/overflow/", "/provider/")
"""What follows a route cluster's name in the names of its overflow aggregates and paid
pools' clusters (``policies.names``): starts there are the route's demand too."""


RISE_SIGMAS = 2.0
"""The recent rate (the last ``RECENT_WINDOW`` seconds) replaces the long one when it is
above it by more than this many standard deviations of its own count: a rise shows within
seconds, the noise of a few seconds' count does not."""
RECENT_WINDOW = 4.0
"""Seconds of the recent rate (``xdsserver.arrivals.CHANGE_WINDOW``)."""


def blend_demand(long: float, recent: float | None) -> float:
    """The demand overflow reads: the long window's rate, or the recent one when it is
    above it beyond noise (``RISE_SIGMAS``). A fall waits for the long window (and the
    hysteresis), so the share is not given back on a quiet second."""
    if recent is None or recent <= long:
        return long
    expected = long * RECENT_WINDOW
    if (recent - long) * RECENT_WINDOW > RISE_SIGMAS * math.sqrt(max(expected, 1.0)):
        return recent
    return long


def route_of(cluster: str) -> str:
    """The route cluster (``policy/route``) that a route cluster, one of its overflow
    aggregates or one of its paid pools' clusters belongs to."""
    for part in OVERFLOW_PARTS:
        head, found, _ = cluster.partition(part)
        if found:
            return head
    return cluster


def route_demand(rates: Mapping[str, float], route: str) -> float:
    """A route's demand: the requests per second started on its own cluster (`route`,
    ``policy/route``) and on its overflow aggregates and paid pools' clusters, by every fleet,
    from ``fleet/cluster`` rates (``ArrivalBook.rates``, or every replica's through
    ``controlplane.arrivals``)."""
    total = 0.0
    for key, rate in rates.items():
        _, _, cluster = key.partition("/")
        if cluster == route or any(cluster.startswith(route + part) for part in OVERFLOW_PARTS):
            total += rate
    return round(total, 4)


__all__ = [
    "OVERFLOW_PARTS",
    "RECENT_WINDOW",
    "RISE_SIGMAS",
    "blend_demand",
    "route_demand",
    "route_of",
]
