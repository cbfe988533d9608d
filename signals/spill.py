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

A locality that comes back
--------------------------
When a fleet's own locality lost every replica and has some again (a region back after an
outage), ``keep`` starts at ``FLOOR`` and rises by ``STEP`` every ``DWELL`` seconds: the region
takes its traffic back gradually, its caches warm, and a replica that is not quite ready is
not flooded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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

    @property
    def overprovisioning(self) -> int:
        """The ClusterLoadAssignment's overprovisioning factor, in percent."""
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


def decide_spill(
    previous: SpillDecision | None,
    *,
    local: int,
    fill: float | None,
    now: float,
    next_fill: float | None = None,
) -> SpillDecision:
    """This round's share for one fleet and route, from the last round's, the number of
    replicas in the fleet's priority 0 and their batch fill; `next_fill` is the fill of the
    priority that would take the spill (a spill into replicas that queue as well gains
    nothing, so none is added then)."""
    before = previous or SpillDecision()
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
        return SpillDecision(keep=FLOOR, since=now, local=local, fill=fill)
    if now - before.since < DWELL:
        pass
    elif fill is not None and fill > HIGH_FILL:
        draining = keep < 1.0 and before.step_fill is not None and fill < before.step_fill
        if not draining and (next_fill is None or next_fill < HIGH_FILL):
            keep = max(FLOOR, keep * max(MAX_CUT, TARGET_FILL / fill))
    elif keep < 1.0 and (fill is None or fill < LOW_FILL):
        keep = min(1.0, keep + STEP)
    keep = round(keep, 4)
    if keep == before.keep:
        return SpillDecision(
            keep=keep, since=before.since, local=local, fill=fill, step_fill=before.step_fill
        )
    return SpillDecision(keep=keep, since=now, local=local, fill=fill, step_fill=fill)


__all__ = [
    "DWELL",
    "ENVOY_OVERPROVISIONING",
    "FLOOR",
    "HIGH_FILL",
    "LOW_FILL",
    "STEP",
    "TARGET_FILL",
    "SpillDecision",
    "decide_spill",
]
