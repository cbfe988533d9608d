"""When a route's replicas are saturated, for bounded load that tightens then (pure, no I/O).

Which routes use it
-------------------
Routes with ``balancing: telemetry`` and session affinity whose
``sessionAffinity.saturatedHashBalanceFactor`` is set (100 by default on such routes). Their
affinity cluster has a second consistent-hash twin: the same endpoints, the same EDS
resource and so the same ring, bounded at that tighter factor. The route's session entries
point at one twin or the other; this module decides which, from the same telemetry records
the weights read, and the choice travels in the route configuration (RDS): no cluster
changes, so Envoy keeps both twins' in-flight counts and connections.

Why two bounds
--------------
Bounded load caps a host at a factor of the mean requests in flight. In the scenario
benchmark, with room in the pool, 125% was best: a turn spills only from a replica that is
clearly busier than the rest, and a spilled turn pays its whole history's prefill
elsewhere. Once the replicas' batches are full, what costs is a queue at one replica while
another has a free slot, and there 100% (no host above the mean, rounded up) cut TTFT p99
in overload to under half of 125%'s, for a few points of hit rate. One factor cannot be
both; Envoy counts requests per cluster, and changing a cluster's factor (CDS) gives Envoy
a new cluster whose hosts start with nothing counted, so the factor is not changed in place.

The signal
----------
Batch fill: for each fresh record (younger than the pool's ``maxAge``) of the route's
first tier that knows its batch size, ``(running + waiting) / max_running``; the pool's fill
is their mean. Saturated from the fill at which the usual bound lets a replica's batch
overflow: ``100 / hashBalanceFactor`` (0.8 at 125%; a replica may carry 1.25 times the mean,
so at a mean fill of 0.8 the busiest one queues while others have room). Calm again at
``CALM_SHARE`` of that or below (0.6 at 125%), and not before ``MIN_DWELL`` seconds in the
saturated state: the band and the dwell keep a pool near the bound from switching twins
every round. In the scenario benchmark chat at 75% of capacity peaked at a fill of 0.70 and
the 110% overload held 0.75 to 1.1. Without a record that knows its batch size
(``kvpilot agent --max-running``) there is no fill, and the route stays calm.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.models import Endpoint
from signals.telemetry import TelemetryRecord

CALM_SHARE = 0.75
"""A saturated pool is calm again at this share of the fill that saturates it ..."""
MIN_DWELL = 5.0
"""... once it has been saturated for at least this many seconds."""


def saturated_fill(hash_balance_factor: int) -> float:
    """The mean batch fill at which a route bounded at `hash_balance_factor` percent counts
    as saturated: where its busiest replica may reach a full batch (1.0 without a bound)."""
    return min(1.0, 100 / hash_balance_factor) if hash_balance_factor else 1.0


@dataclass(frozen=True, slots=True)
class SaturationDecision:
    """Whether one route's replicas are saturated; kept between rounds for hysteresis."""

    saturated: bool = False
    """Session requests go to the tighter twin."""
    since: float = -math.inf
    """Wall-clock time of the last change."""
    # For operators; they change nothing Envoy is sent, so they are left out of equality.
    fill: float | None = field(default=None, compare=False)
    """Mean batch fill this round; ``None`` without a fresh record that knows its batch."""
    bound: float = field(default=1.0, compare=False)
    """The fill at which the route counts as saturated (``saturated_fill``)."""

    @property
    def calm_at(self) -> float:
        """When a saturated route whose fill is already down to the calm bound turns calm if
        nothing changes (its dwell ends): the control plane rebuilds then even if no telemetry
        arrives. Infinite otherwise."""
        if self.saturated and self.fill is not None and self.fill <= self.bound * CALM_SHARE:
            return self.since + MIN_DWELL
        return math.inf


def batch_fill(
    endpoints: Sequence[Endpoint],
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float,
    max_age: float,
) -> float | None:
    """The mean batch fill of the replicas ``endpoints`` (see the module notes);
    ``telemetry`` is keyed by ``Endpoint.key``."""
    fills = [
        ((record.running or 0.0) + (record.waiting or 0.0)) / record.max_running
        for endpoint in endpoints
        if (record := telemetry.get(endpoint.key)) is not None
        and record.max_running is not None
        and now - record.at <= max_age
    ]
    return round(statistics.fmean(fills), 6) if fills else None


def decide_saturation(
    previous: SaturationDecision | None, fill: float | None, *, now: float, bound: float
) -> SaturationDecision:
    """This round's decision from the last one and the pool's batch fill; `bound` is the
    fill that saturates the route (``saturated_fill``)."""
    before = previous or SaturationDecision()
    saturated = before.saturated
    if fill is None:
        # No evidence: fail calm, as stale weights go neutral.
        saturated = False
    elif not saturated and fill >= bound:
        saturated = True
    elif saturated and fill <= bound * CALM_SHARE and now - before.since >= MIN_DWELL:
        saturated = False
    since = before.since if saturated == before.saturated else now
    return SaturationDecision(saturated=saturated, since=since, fill=fill, bound=bound)


__all__ = [
    "CALM_SHARE",
    "MIN_DWELL",
    "SaturationDecision",
    "batch_fill",
    "decide_saturation",
    "saturated_fill",
]
