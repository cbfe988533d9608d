"""The arithmetic of overflow by arrivals' share (pure, no I/O): the capacity before one is
measured, the drain of a queue beyond the route's objective, and the split of the paid share
between requests without a session and conversations. ``signals.overflowff`` decides with
them."""

from __future__ import annotations

import math

from signals.spill import DRAIN_S

PRIOR_SHARE = 0.7
"""The prior capacity before any saturated period: this share of batch slots over the
mean service time seen so far (module docstring)."""
PLAIN_PRIOR = 0.5
"""Share of the demand without a session assumed before it was seen."""
QUEUE_WAIT = 0.5
"""Share of the route's TTFT objective (``Overflow.ttft``) a request may spend waiting for
a batch slot: the queue the owned replicas may hold is this much of the objective times
their capacity, the rest of the objective is left to the prefill (the fill loop's TTFT
signal bounds the engines' time to first token at half of it too)."""


def capacity_of(
    per_slot: float | None, slots: float, service_time: float | None
) -> tuple[float | None, bool]:
    """(capacity in requests per second, measured): the held full-batch rate per slot times
    the slots, else the conservative prior, else None."""
    if slots <= 0:
        return None, False
    if per_slot is not None:
        return round(per_slot * slots, 4), True
    if service_time is not None and service_time > 0:
        return round(PRIOR_SHARE * slots / service_time, 4), False
    return None, False


def drain_rate(
    queued: float | None, capacity: float, objective: float | None
) -> tuple[float, float]:
    """(requests per second to send to the paid pools to drain the owned replicas' queue,
    the queue allowed): the queue beyond what a request may wait for a slot within the TTFT
    `objective` (``QUEUE_WAIT`` of it, at `capacity` requests per second), sent over
    ``DRAIN_S`` (as spill's drain). Nothing without an objective or a queue.

    A queue the peak left behind is a wait every later arrival pays until the replicas have
    served it; the estimate from demand and capacity keeps the queue from growing but does
    not shrink it, and the trim moves slowly (``DWELL``). Each request drained costs what a
    paid request costs, and each is one that would have missed the objective."""
    if objective is None or queued is None or capacity <= 0:
        return 0.0, math.inf
    allowed = capacity * objective * QUEUE_WAIT
    return round(max(0.0, queued - allowed) / DRAIN_S, 4), round(allowed, 4)


def kind_shares(paid: float, plain_share: float | None, conversations: str) -> tuple[float, float]:
    """(share of requests without a session, share of conversations) that send `paid` of
    the whole demand to the paid pools; plain requests first with ``conversations: last``."""
    if conversations == "with":
        return paid, paid
    p = PLAIN_PRIOR if plain_share is None else min(1.0, max(0.0, plain_share))
    if p <= 0:
        return (1.0 if paid > 0 else 0.0), paid
    plain = min(1.0, paid / p)
    sessions = max(0.0, (paid - p) / (1.0 - p)) if p < 1.0 else 0.0
    return round(plain, 6), round(min(1.0, sessions), 6)


__all__ = ["PLAIN_PRIOR", "PRIOR_SHARE", "QUEUE_WAIT", "capacity_of", "drain_rate", "kind_shares"]
