"""How much of a fleet's traffic its own locality keeps, and how much spills (pure, no I/O).

The mechanism
-------------
A fleet with a locality gets each route's replicas as EDS priorities: its own zone, then its
own region, then other regions (``compiler.locality``). Envoy spills from priority 0 by
health: a priority whose healthy share is h takes ``min(1, h x overprovisioning factor)`` of
the traffic, 1.4 by default, the rest goes on to the next priority. That moves traffic away
from dead or draining replicas by itself, within the Envoy, at once. What Envoy cannot see is
saturation: a region whose replicas are all healthy and all queueing keeps all of its
fleet's traffic. kvpilot sees it in telemetry, and spills by lowering the factor of that
fleet's ClusterLoadAssignment: at a factor of 100 x ``keep`` a fully healthy priority 0
takes ``keep`` of the traffic and the next priority the rest. Only the excess crosses.

The loop
--------
The signal is the batch fill of the fleet's priority-0 replicas (``(running + waiting) /
max_running``, their mean, as ``signals.saturation``). Above ``HIGH_FILL`` the locality is
queueing: ``keep`` falls in proportion (``keep x TARGET_FILL / fill``, to no less than
``MAX_CUT`` of itself a step), unless the fill has fallen since the last step (the queue is
draining: the last cut is working, and cutting again before it shows overshoots). Below
``LOW_FILL`` it has room again: ``keep`` rises by ``STEP``. Between the two it holds
(hysteresis), and it changes at most once per ``DWELL`` seconds, so each step is seen in
telemetry before the next. ``keep`` never goes below ``FLOOR`` whatever the
telemetry says (a wrong reading cannot send the whole fleet away), and rises back towards 1
when the fill is unknown (stale or missing telemetry: fail local; Envoy's health spill still
works).

Feed-forward: the fleet's arrivals against its locality's capacity
-------------------------------------------------------------------
Batch fill shows a cut only as the requests admitted before it finish (seconds for LLM
requests), and a queue that formed before the cut keeps the fill high after the rate is
right. Where Envoy reports each request's start (``xdsserver.arrivals``), the loop knows the
fleet's arrival rate A and its locality's capacity C (its batch slots over the mean time one
request is served there, Little's law), and sets ``keep = trim x LOAD x C / A`` (at most 1)
at once: only the excess crosses, and a locality that lost replicas (a spot wave) loses
their capacity in the same round. The fill loop above then corrects the estimate rather than
the share: ``trim`` falls when the fill queues and rises back when it has room, with the
same dwell, and the floor still holds. While the estimate says no spill is needed, only a
queue that lasts ``LASTING`` seconds moves ``trim``: arrivals come in bursts, and one queues for a
moment well under capacity. Moves of ``keep`` smaller than ``DEADBAND`` are left
out, so the noise of a Poisson arrival count does not push Envoy a new factor every round.

The queue a locality already has
--------------------------------
Feed-forward gives the locality ``LOAD`` of its capacity from the round the overload is seen,
but the requests that arrived before that are queued in its replicas, and at 97% of capacity
that queue drains at 3% of it: slowly, and every request behind it waits. Where telemetry
gives the replicas' waiting requests Q, the share also sends the queue's excess away:
``keep = (trim x LOAD x C - max(0, Q - Q0) / DRAIN_S) / A``, the locality taking that much
less than its capacity until the excess has drained, in about ``DRAIN_S`` seconds. Q0
(``queue_chance``) is the queue a Poisson load near capacity has without any overload: over
one service time a locality of S slots at capacity gets a Poisson count of about S arrivals,
whose standard deviation is sqrt(S), and the count above S waits; ``QUEUE_SIGMAS`` standard
deviations of it (32 for 4 replicas of 16 slots) is chance, more is a queue to drain. With Q
known, ``trim`` falls only for a queue beyond Q0 that lasts ``LASTING`` seconds (the drain
term takes the one that formed before the spill; a batch fill over ``HIGH_FILL`` within Q0 is
the queue of a load at capacity, which feed-forward sets) and rises only for a fill under
``LOW_FILL`` that lasts as long (at ``LOAD`` of its capacity a locality's fill dips under it
by chance, one standard deviation at 64 slots, and a ``trim`` raised then under-spills), and
a move of ``keep`` under ``DEADBAND`` is made once it has waited ``SETTLE`` seconds, so
``keep`` settles on the estimate rather than up to 5 points off it.

Where the others have room: the cluster's mean load
----------------------------------------------------
A locality far above the cluster's mean load, while the others have room (a spot wave took
its replicas), is given that mean of its capacity instead of ``LOAD``: it sends what puts it
level with the rest (``signals.spilllevel``). Near the cluster's capacity ``LOAD`` holds,
and only the excess crosses.

With feed-forward the factor also counts priority 0's healthy share h: Envoy gives it
``h x factor``, so the factor is ``keep / h``, never more than Envoy's own 140 (health
spill stays an upper bound on what the locality keeps). Envoy's h leaves draining hosts
out of the count (they are excluded, not unhealthy), and so does the h it is given
(``compiler.locality.spill_decision``).

A locality that comes back
--------------------------
When a fleet's own locality lost every replica and has some again (a region back after an
outage), ``keep`` starts at ``FLOOR`` and rises by ``STEP`` every ``DWELL`` seconds: the region
takes its traffic back gradually, its caches warm, and a replica that is not quite ready is
not flooded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from signals.spilllevel import DEFAULT_SLOTS, levels, queue_free_load

ENVOY_OVERPROVISIONING = 140
"""Envoy's default overprovisioning factor, in percent: what a locality keeping everything
gets, so health-based spill works as Envoy's own."""
FLOOR = 0.5
"""The least share a fleet's own locality keeps. With two priorities both fully healthy, a
factor below 50 makes Envoy normalise the shares (their sum is below 100) and priority 0
would take half anyway."""
TARGET_FILL = 0.95
"""The batch fill a saturated locality is brought back to."""
HIGH_FILL = 1.05
"""Above this mean fill the locality's replicas queue (more than 5% of their batch slots
waiting): spill more."""
LOW_FILL = 0.85
"""Below this the locality has room: keep more."""
STEP = 0.1
"""How much ``keep`` rises per step, when the locality has room or comes back."""
LOAD = 0.97
"""The share of its capacity a locality is given by feed-forward: a little under 1, so a queue
that formed while the spill was found drains."""
DEADBAND = 0.05
"""Feed-forward leaves ``keep`` alone when its new value is this close: the arrival rate over
a few seconds is a Poisson count, and every move of the factor is an EDS push."""
LASTING = 15.0
"""Seconds a queue must last, while the estimate says the locality has room, before it lowers
``trim``: at 70% of capacity a burst of arrivals queues for several seconds (seen in the
regions benchmark with 5 s), and a ``trim`` learned then over-spills the next overload."""
TRIM_RANGE = (0.5, 1.5)
"""Bounds of the fill loop's correction of the feed-forward estimate."""
DRAIN_S = 5.0
"""Seconds in which the drain term sends away a lasting queue's excess over chance."""
QUEUE_SIGMAS = 4.0
"""Standard deviations of a Poisson count of one service time's arrivals (sqrt of the
locality's slots) that a queue reaches by chance at capacity (``queue_chance``)."""
SETTLE = 10.0
"""Seconds after the last change of ``keep`` from which a move under ``DEADBAND`` is made
(with the queue known): the estimate holds that long, so it is not noise."""
MAX_CUT = 0.85
"""``keep`` falls at most to this share of itself in one step."""
DWELL = 5.0
"""Seconds between two changes of ``keep``: a change shows in the batch fill only as the
requests admitted before it finish, and LLM requests last seconds. In the regions benchmark
(8 s requests) a 2 s dwell with cuts of up to 30% cut 113% of load down to half kept, where
a tenth had to go."""


@dataclass(frozen=True, slots=True)
class SpillDecision:
    """What share of one fleet's traffic for one route stays in the fleet's own locality."""

    keep: float = 1.0
    """Share kept at priority 0, ``FLOOR`` to 1."""
    since: float = -math.inf
    """Wall-clock time of the last change of ``keep``."""
    local: int = 0
    """Replicas of the fleet's own locality that serve this round (healthy or degraded)."""
    outage: bool = False
    """The locality had replicas and lost them all; it ramps back when they return. A fleet
    whose locality never had any (a new fleet, before its replicas register) is not in an
    outage and takes its traffic at once."""
    fill: float | None = field(default=None, compare=False)
    """Mean batch fill of those replicas; ``None`` without fresh telemetry."""
    step_fill: float | None = field(default=None, compare=False)
    """The fill when ``keep`` last changed: a queue that has shrunk since is draining, and
    the last cut is left to work before another."""
    arrivals: float | None = field(default=None, compare=False)
    """Requests per second the fleet's Envoys started on this route (feed-forward); None:
    not reported."""
    capacity: float | None = field(default=None, compare=False)
    """Requests per second the fleet's own locality can serve: its serving replicas' batch
    slots over the mean service time there; None: unknown."""
    trim: float = 1.0
    """The fill loop's correction of the feed-forward estimate (``TRIM_RANGE``)."""
    trim_since: float = -math.inf
    """Wall-clock time of the last change of ``trim``."""
    healthy: float = 1.0
    """Share of priority 0's replicas that serve (Envoy scales the factor by it)."""
    ramp: bool = False
    """The locality is taking its traffic back after an outage, ``STEP`` per ``DWELL``,
    whatever the feed-forward would allow."""
    high_since: float = field(default=math.inf, compare=False)
    """Since when the fill has been above ``HIGH_FILL`` (infinite: it is not)."""
    low_since: float = field(default=math.inf, compare=False)
    """Since when the fill has been below ``LOW_FILL`` (infinite: it is not)."""
    queued: float | None = field(default=None, compare=False)
    """Requests waiting in the locality's replicas (telemetry); None: not known."""
    slots: int | None = field(default=None, compare=False)
    """Batch slots of the locality's serving replicas with fresh telemetry."""
    slot_capacity: float | None = field(default=None, compare=False)
    """Requests per second by the slots over the service time alone (before the completion
    rate's floor)."""
    completed: float | None = field(default=None, compare=False)
    """Requests per second the locality's replicas completed lately (the capacity's floor)."""
    drain: float = field(default=0.0, compare=False)
    """Requests per second taken off the locality's share to drain its queue's excess."""
    mean_load: float | None = field(default=None, compare=False)
    """Every fleet's arrivals on the routes over the same pools, over the capacity of all
    their serving replicas (``compiler.locality.mean_load``); None: not known."""
    level: float = field(default=LOAD, compare=False)
    """The share of its capacity the locality was given this round: ``LOAD``, or the mean
    load while it levels with the cluster (``balancing``)."""
    balancing: bool = False
    """The locality's own load is well above the cluster's mean and it levels with it."""

    @property
    def feed_forward(self) -> bool:
        """True when ``keep`` came from the arrival rate and the capacity."""
        return bool(self.arrivals and self.capacity)

    @property
    def overprovisioning(self) -> int:
        """The ClusterLoadAssignment's overprovisioning factor, in percent."""
        if self.feed_forward and self.keep < 1.0:
            # Envoy gives priority 0 min(1, healthy x factor): the factor that gives it `keep`
            # with only part of it healthy, never above Envoy's own (health spill still
            # bounds what the locality keeps).
            wanted = 100 * self.keep / max(self.healthy, 0.01)
            return max(1, min(ENVOY_OVERPROVISIONING, round(wanted)))
        if self.keep >= 1.0:
            return ENVOY_OVERPROVISIONING
        return max(1, round(100 * self.keep))

    @property
    def next_at(self) -> float:
        """When the next step is due although no telemetry arrives (a locality that came
        back and is still ramping up); infinite otherwise."""
        if self.keep < 1.0 and self.local and (self.fill is None or self.fill < LOW_FILL):
            return self.since + DWELL
        return math.inf


def queue_chance(slots: int) -> float:
    """The queue a locality of `slots` batch slots has by chance at capacity (module
    docstring): ``QUEUE_SIGMAS`` x sqrt(slots)."""
    return QUEUE_SIGMAS * math.sqrt(max(slots, 0))


def decide_spill(
    previous: SpillDecision | None,
    *,
    local: int,
    fill: float | None,
    now: float,
    next_fill: float | None = None,
    arrivals: float | None = None,
    capacity: float | None = None,
    healthy: float = 1.0,
    queued: float | None = None,
    slots: int | None = None,
    slot_capacity: float | None = None,
    completed: float | None = None,
    mean_load: float | None = None,
) -> SpillDecision:
    """This round's share for one fleet and route, from the last round's, the number of
    replicas in the fleet's priority 0 and their batch fill; `next_fill` is the fill of the
    priority that would take the spill (a spill into replicas that queue as well gains
    nothing, so none is added then). With `arrivals` and `capacity` (requests per second)
    the share follows them at once and the fill corrects the estimate (module docstring);
    `healthy` is the share of priority 0's replicas that serve. `queued` (requests waiting in
    the locality's replicas) and `slots` (their batch slots) give the drain term; without
    them the share is as before. `slot_capacity` and `completed` (the capacity's two parts)
    are kept for status. `mean_load` is the cluster's, with which a locality well above it
    levels (module docstring)."""
    decision = _decide(
        previous,
        local=local,
        fill=fill,
        now=now,
        next_fill=next_fill,
        arrivals=arrivals,
        capacity=capacity,
        healthy=healthy,
        queued=queued,
        slots=slots,
        mean_load=mean_load,
    )
    # Shown in status and logs although the fill loop decided (no capacity yet).
    return replace(
        decision,
        arrivals=arrivals if decision.arrivals is None else decision.arrivals,
        queued=queued,
        slots=slots,
        slot_capacity=slot_capacity,
        completed=completed,
        mean_load=mean_load,
    )


def _decide(
    previous: SpillDecision | None,
    *,
    local: int,
    fill: float | None,
    now: float,
    next_fill: float | None,
    arrivals: float | None,
    capacity: float | None,
    healthy: float,
    queued: float | None,
    slots: int | None,
    mean_load: float | None,
) -> SpillDecision:
    before = previous or SpillDecision()
    if arrivals and capacity and local > 0 and not before.outage:
        # (A ramp after an outage goes on under feed-forward, limited by it.)
        return _feed_forward(
            before,
            local=local,
            fill=fill,
            now=now,
            next_fill=next_fill,
            arrivals=arrivals,
            capacity=capacity,
            healthy=healthy,
            queued=queued,
            slots=slots,
            mean_load=mean_load,
        )
    keep = before.keep
    if local == 0:
        # Nothing to keep: Envoy sends everything on by health. Remember an outage, so the
        # locality ramps back from the floor when its replicas return.
        outage = before.outage or before.local > 0
        keep = FLOOR if outage else 1.0
        since = before.since if keep == before.keep else now
        return SpillDecision(keep=keep, since=since, local=0, fill=fill, outage=outage)
    if before.outage:
        # Back from an outage: start low, rise by steps from now.
        return SpillDecision(keep=FLOOR, since=now, local=local, fill=fill, ramp=True)
    if now - before.since < DWELL:
        pass
    elif fill is not None and fill > HIGH_FILL:
        draining = keep < 1.0 and before.step_fill is not None and fill < before.step_fill
        if not draining and (next_fill is None or next_fill < HIGH_FILL):
            keep = max(FLOOR, keep * max(MAX_CUT, TARGET_FILL / fill))
    elif keep < 1.0 and (fill is None or fill < LOW_FILL):
        keep = min(1.0, keep + STEP)
    keep = round(keep, 4)
    # A ramp after an outage stays one until it reaches all of the traffic, so that feed-
    # forward, when its signal comes back, goes on from the ramp rather than jumping.
    ramp = before.ramp and keep < 1.0
    if keep == before.keep:
        return SpillDecision(
            keep=keep,
            since=before.since,
            local=local,
            fill=fill,
            step_fill=before.step_fill,
            ramp=ramp,
        )
    return SpillDecision(keep=keep, since=now, local=local, fill=fill, step_fill=fill, ramp=ramp)


def _feed_forward(
    before: SpillDecision,
    *,
    local: int,
    fill: float | None,
    now: float,
    next_fill: float | None,
    arrivals: float,
    capacity: float,
    healthy: float,
    queued: float | None = None,
    slots: int | None = None,
    mean_load: float | None = None,
) -> SpillDecision:
    """The share from the arrival rate and the capacity, corrected by the fill loop, less
    the drain of a queue beyond chance (with `queued` and `slots`); `LOAD` of the capacity,
    or while the locality levels with the cluster its `mean_load`, no lower than the load
    its slots serve with hardly a wait (``queue_free_load``)."""
    balancing = levels(
        before.balancing,
        own=arrivals / capacity,
        mean=mean_load,
        slots=slots,
        next_room=next_fill is not None and next_fill < LOW_FILL,
        next_queues=next_fill is None or next_fill >= HIGH_FILL,
    )
    # Levelled, a locality still keeps what its slots serve at once (``queue_free_load``):
    # below that, what is sent away would not have waited at home, and pays the round trip.
    level = (
        max(mean_load, queue_free_load(slots or DEFAULT_SLOTS))
        if balancing and mean_load is not None
        else LOAD
    )
    knows_queue = queued is not None and bool(slots)
    trim, trim_since = before.trim, before.trim_since
    # With the queue known, a queue within chance of a load at capacity (which feed-forward
    # sets) says nothing of the estimate: only one beyond it is queueing.
    if knows_queue and queued is not None and slots:
        queueing = fill is not None and queued > queue_chance(slots)
    else:
        queueing = fill is not None and fill > HIGH_FILL
    high_since = (before.high_since if before.high_since <= now else now) if queueing else math.inf
    # Room is under the level the locality is given: levelled at 72% its fill sits there.
    roomy = fill is not None and fill < LOW_FILL * level / LOAD
    low_since = (before.low_since if before.low_since <= now else now) if roomy else math.inf
    # While the estimate says the locality has room (no spill), a queue says it is wrong only
    # when it lasts: a burst of arrivals queues for a moment at 70% of capacity too.
    spilling = arrivals >= trim * level * capacity
    # The fill shows a change of the share only as the requests admitted before it finish.
    if now - max(trim_since, before.since) >= DWELL:
        wanted = trim
        if fill is not None and queueing:
            draining = before.step_fill is not None and fill < before.step_fill
            # A spill already in force for a dwell that still queues: the estimate is too
            # high. (Not in the round the spill starts: that queue formed before it.)
            # With the queue known the drain term takes the one that formed before the
            # spill: only a queue that lasts says the estimate is wrong.
            lasting = (
                spilling and before.keep < 1.0 and not knows_queue
            ) or now - high_since >= LASTING
            if lasting and not draining and (next_fill is None or next_fill < HIGH_FILL):
                wanted = trim * max(MAX_CUT, TARGET_FILL / fill)
        elif before.keep < 1.0 and (fill is None or roomy):
            # Room while spilling: the estimate is too low. With the queue known, only room
            # that lasts: given LOAD of its capacity, a locality's fill is a Poisson count of
            # about its slots over their number, and dips under LOW_FILL by chance for
            # seconds (one standard deviation at 64 slots), as a queue rises over HIGH_FILL.
            if not knows_queue or fill is None or now - low_since >= LASTING:
                wanted = trim + STEP
        elif trim < 1.0 and (fill is None or fill < LOW_FILL):
            # No spill needed and room to spare: the correction relaxes.
            wanted = min(1.0, trim + STEP)
        wanted = round(min(TRIM_RANGE[1], max(TRIM_RANGE[0], wanted)), 4)
        if wanted != trim:
            trim, trim_since = wanted, now
    drain = 0.0
    # Not into a next priority without serving replicas, or one that queues as well: the
    # queue would only move (as the fill loop adds no spill there).
    room_next = next_fill is None or next_fill < HIGH_FILL
    if knows_queue and queued is not None and slots and room_next:
        drain = max(0.0, queued - queue_chance(slots)) / DRAIN_S
    target = round(max(FLOOR, min(1.0, (trim * level * capacity - drain) / arrivals)), 4)
    keep, since, step_fill = before.keep, before.since, before.step_fill
    ramp = before.ramp
    # A small move that the estimate holds for a while is made (with the queue known).
    settled = knows_queue and target != keep and now - since >= SETTLE
    if ramp and target > keep:
        # Back from an outage: up by steps, never faster than the ramp.
        if now - since >= DWELL:
            keep, since, step_fill = round(min(target, keep + STEP), 4), now, fill
        ramp = keep < target
    elif abs(target - keep) >= DEADBAND or (target == 1.0 and keep != 1.0) or settled:
        keep, since, step_fill, ramp = target, now, fill, False
    return SpillDecision(
        keep=keep,
        since=since,
        local=local,
        fill=fill,
        step_fill=step_fill,
        arrivals=arrivals,
        capacity=capacity,
        trim=trim,
        trim_since=trim_since,
        healthy=healthy,
        ramp=ramp,
        high_since=high_since,
        low_since=low_since,
        drain=round(drain, 4),
        mean_load=mean_load,
        level=level,
        balancing=balancing,
    )


__all__ = [
    "DEADBAND",
    "DRAIN_S",
    "DWELL",
    "ENVOY_OVERPROVISIONING",
    "FLOOR",
    "HIGH_FILL",
    "LASTING",
    "LOAD",
    "LOW_FILL",
    "QUEUE_SIGMAS",
    "SETTLE",
    "STEP",
    "TARGET_FILL",
    "SpillDecision",
    "decide_spill",
    "queue_chance",
]
