"""Per-fleet views of a route's replicas: EDS priorities by place and by capacity kind.

A route's cluster lists its replicas with failover tier k at priority k. For a fleet that
declares where it runs (``Fleet.spec.locality``) each tier is split again, nearest first: the
fleet's own zone, the rest of its own region, then every other region (endpoints without a
locality count as far away). For a pool with ``preferCapacity`` each of those is split once
more by capacity kind, the preferred kind first (the cheapest first where the pool prices its
kinds, ``PoolSpec.capacity_order``). The resulting (tier, place, kind) groups
become priorities 0, 1, 2, ... in that order, without gaps, so Envoy's priority machinery
does the rest: a priority spills to the next what its health cannot serve (the
overprovisioning factor, 1.4 by default), a draining or dead replica's share moves at once,
and a consistent hash chooses the priority with the request's hash, so a session stays in
the locality that serves it. Saturation, which Envoy cannot see, moves the factor
(``signals.spill``). Pure: plan clusters in, plan clusters out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from compiler.plan import PlanCluster, PlanEndpoint
from policies.models import Capacity, FleetSpec, Locality, Pool
from signals.saturation import batch_fill
from signals.spill import SpillDecision, decide_spill
from signals.state import PolicyState, pool_endpoints
from signals.telemetry import TelemetryRecord

NEAR, REGION, FAR = 0, 1, 2
"""Place ranks of an endpoint seen from a fleet: same zone, same region, elsewhere."""


def place_rank(endpoint: PlanEndpoint, where: Locality | None) -> int:
    """How far `endpoint` is from a fleet at `where` (``NEAR``, ``REGION`` or ``FAR``); every
    endpoint is ``NEAR`` to a fleet without a locality."""
    if where is None:
        return NEAR
    if endpoint.region != where.region or not endpoint.region:
        return FAR
    if where.zone and endpoint.zone == where.zone:
        return NEAR
    return REGION if where.zone else NEAR


def capacity_rank(endpoint: PlanEndpoint, prefer: Sequence[Capacity]) -> int:
    """Position of the endpoint's capacity kind in its pool's preference (unlisted last)."""
    for index, kind in enumerate(prefer):
        if endpoint.capacity == kind:
            return index
    return len(prefer)


def needs_view(cluster: PlanCluster, where: Locality | None, pools: Mapping[str, Pool]) -> bool:
    """True when the fleet's view of `cluster` differs from the shared one."""
    if cluster.kind != "eds" or not cluster.endpoints:
        return False
    if where is not None:
        return True
    return any(
        (pool := pools.get(name)) is not None and pool.spec.prefer_capacity
        for name in {endpoint.pool for endpoint in cluster.endpoints}
    )


def fleet_view(
    cluster: PlanCluster, where: Locality | None, pools: Mapping[str, Pool]
) -> PlanCluster:
    """`cluster` with its endpoints' priorities as a fleet at `where` gets them."""
    prefer = {
        name: pool.spec.capacity_order()
        for name in {endpoint.pool for endpoint in cluster.endpoints}
        if (pool := pools.get(name)) is not None
    }

    def key(endpoint: PlanEndpoint) -> tuple[int, int, int]:
        return (
            endpoint.priority,
            place_rank(endpoint, where),
            capacity_rank(endpoint, prefer.get(endpoint.pool, [])),
        )

    levels = {
        group: index for index, group in enumerate(sorted({key(e) for e in cluster.endpoints}))
    }
    endpoints = tuple(e._replace(priority=levels[key(e)]) for e in cluster.endpoints)
    return replace(cluster, endpoints=endpoints)


PLACE_SEPARATOR = "@"
"""Between a fleet's name and a place in the name of that fleet's view for one place
(``edge@us-east``, ``edge@us-east/us-east-a``): fleet names hold neither '@' nor '/'."""


def placed_views(
    fleet: str, settings: FleetSpec, state: PolicyState
) -> list[tuple[str, Locality | None]]:
    """The views `fleet` gets, each a (name, locality): the fleet's own (at its Fleet
    locality, or none); with ``nodeLocality``, one more for each region and each zone that
    has replicas, for the Envoys whose node.locality says they run there
    (``xdsserver.snapshot.SnapshotCache.view_for`` picks it)."""
    views: list[tuple[str, Locality | None]] = [(fleet, settings.locality)]
    if not settings.node_locality:
        return views
    places: set[tuple[str, str]] = set()
    for name, pool in state.pools.items():
        for endpoint in pool_endpoints(pool, state.registered.get(name, {})):
            if endpoint.locality is not None and endpoint.locality.region:
                places.add((endpoint.locality.region, ""))
                if endpoint.locality.zone:
                    places.add((endpoint.locality.region, endpoint.locality.zone))
    for region, zone in sorted(places):
        place = f"{region}/{zone}" if zone else region
        views.append((f"{fleet}{PLACE_SEPARATOR}{place}", Locality(region=region, zone=zone)))
    return views


def priorities(cluster: PlanCluster) -> int:
    """How many priorities the cluster's endpoints use."""
    return len({endpoint.priority for endpoint in cluster.endpoints})


def spill_key(fleet: str, cluster: str) -> str:
    """Key of a fleet's spill decision for one cluster (fleet names hold no '/')."""
    return f"{fleet}/{cluster}"


def spill_decision(
    fleet: str,
    cluster: PlanCluster,
    view: PlanCluster,
    where: Locality | None,
    state: PolicyState,
    *,
    feed_forward: bool = True,
) -> SpillDecision:
    """This round's spill for `fleet`'s `view` of `cluster` (the fleet at `where`): from the
    replicas of its own locality in the first tier that serve (healthy or degraded), the
    telemetry of the replicas at the view's priority 0 and that of priority 1. Decided even
    while the fleet's locality has no replica, so that it ramps back when they return. With
    `feed_forward`, the fleet's arrival rate and its locality's capacity set the share."""
    home = [
        e
        for e in cluster.endpoints
        if e.priority == 0 and e.health in SERVING and place_rank(e, where) == NEAR
    ]
    serving = [e for e in view.endpoints if e.priority == 0 and e.health in SERVING]
    spill_to = [e for e in view.endpoints if e.priority == 1 and e.health in SERVING]
    key = spill_key(fleet, cluster.eds_service or cluster.name)
    first = [e for e in view.endpoints if e.priority == 0]
    parts = capacity_parts(serving, state) if feed_forward else None
    queued, slots = _queue(serving, state) if feed_forward else (None, None)
    everywhere = [e for e in view.endpoints if e.health in SERVING]
    return decide_spill(
        state.previous_spill.get(key),
        local=len(home),
        fill=_fill(serving, state),
        # No replica of the next priority serves: spilling more gains nothing (Envoy keeps
        # everything here anyway), so nothing is cut (as into one that queues).
        next_fill=_fill(spill_to, state) if spill_to else math.inf,
        now=state.now,
        arrivals=state.arrivals.get(key) if feed_forward else None,
        capacity=_capacity_of(parts),
        # Envoy leaves a DRAINING host out of its priority's health (it is excluded, not
        # unhealthy): a drained replica takes no share, and counts in no denominator.
        healthy=len(serving) / len(counted) if (counted := _counted(first)) else 1.0,
        queued=queued,
        slots=slots,
        slot_capacity=parts[0] if parts else None,
        completed=parts[1] if parts else None,
        mean_load=mean_load(everywhere, state) if feed_forward else None,
    )


def mean_load(endpoints: Sequence[PlanEndpoint], state: PolicyState) -> float | None:
    """The load on the serving `endpoints`, whichever locality: the arrivals of every fleet
    on every route whose first tier draws on their pools (one policy per fleet, or several
    routes over one pool, share the replicas) over their capacity. None when either is not
    known. Traffic that no arrivals log reports (Envoys kvpilot does not configure) is not
    in it: ``signals.spilllevel`` levels only into a priority whose batch fill has room."""
    pools = {e.pool for e in endpoints}
    rates = [rate for key, rate in state.arrivals.items() if _first_pools(key, state) & pools]
    pooled = capacity(endpoints, state)
    return round(sum(rates) / pooled, 4) if rates and pooled else None


def _first_pools(key: str, state: PolicyState) -> set[str]:
    """The pools of the first tier of the route an arrivals key (``fleet/policy/route``)
    counts; empty when that route is not in `state`."""
    policy_name, _, route_name = key.partition("/")[2].partition("/")
    policy = state.policies.get(policy_name)
    for route in policy.spec.routes if policy is not None else ():
        if route.name == route_name and route.tiers:
            return {target.pool for target in route.tiers[0].pools}
    return set()


def _fresh(endpoint: PlanEndpoint, state: PolicyState) -> TelemetryRecord | None:
    """`endpoint`'s telemetry record if its pool has telemetry and the record is fresh."""
    pool = state.pools.get(endpoint.pool)
    record = state.telemetry.get(endpoint.pool, {}).get(f"{endpoint.address}:{endpoint.port}")
    if pool is None or pool.spec.telemetry is None or record is None:
        return None
    return record if state.now - record.at <= pool.spec.telemetry.max_age else None


SERVING = ("healthy", "degraded")
"""Endpoint health that takes new requests (a draining endpoint finishes what it has)."""


def _counted(endpoints: Sequence[PlanEndpoint]) -> list[PlanEndpoint]:
    """The endpoints Envoy counts in a priority's health: all but the draining ones (EDS
    ``DRAINING`` hosts are excluded from priority spillover, locality weighting and panic)."""
    return [e for e in endpoints if e.health != "draining"]


def capacity(endpoints: Sequence[PlanEndpoint], state: PolicyState) -> float | None:
    """Requests per second `endpoints` can serve: each one's batch slots (``max_running`` from
    fresh telemetry) over the mean time a request is served there (Little's law at a full
    batch; ``PolicyState.service_times``), a replica without its own time taking the mean of
    the others', or what they completed per second over the last seconds when that is more
    (a full locality's completion rate is its capacity). None when no replica has both a
    fresh batch size and a time."""
    return _capacity_of(capacity_parts(endpoints, state))


def _capacity_of(parts: tuple[float, float] | None) -> float | None:
    return round(max(parts), 4) if parts is not None else None


def capacity_parts(
    endpoints: Sequence[PlanEndpoint], state: PolicyState
) -> tuple[float, float] | None:
    """The two parts of ``capacity``: requests per second by the batch slots over the service
    times, and what the replicas completed per second lately; None where ``capacity`` is."""
    keys = [f"{e.address}:{e.port}" for e in endpoints]
    times = [state.service_times[key] for key in keys if key in state.service_times]
    if not times:
        return None
    mean_time = sum(times) / len(times)
    total = 0.0
    for endpoint, key in zip(endpoints, keys, strict=True):
        record = _fresh(endpoint, state)
        if record is None or not record.max_running:
            continue
        seconds = state.service_times.get(key, mean_time)
        if seconds > 0:
            total += record.max_running / seconds
    if total <= 0:
        return None
    # What the replicas completed is capacity they have: while they are full it is all of
    # it, and it holds where the byte timings lag the batch (a slow stream writer).
    done = sum(state.completions.get(key, 0.0) for key in keys)
    return round(total, 4), round(done, 4)


def _queue(
    endpoints: Sequence[PlanEndpoint], state: PolicyState
) -> tuple[float | None, int | None]:
    """Requests waiting in `endpoints` and their batch slots, from fresh telemetry that
    reports both; (None, None) when none does."""
    waiting, slots = 0.0, 0
    for endpoint in endpoints:
        record = _fresh(endpoint, state)
        if record is None:
            continue
        if record.waiting is None or not record.max_running:
            continue
        waiting += record.waiting
        slots += int(record.max_running)
    return (round(waiting, 4), slots) if slots else (None, None)


def batch_slots(state: PolicyState | None) -> dict[str, int]:
    """``address:port`` -> batch slots (``max_running``) of every replica with fresh telemetry
    that reports them (``xdsserver.arrivals.ArrivalBook`` times only the requests that found
    one free)."""
    if state is None:
        return {}
    out: dict[str, int] = {}
    for name, records in state.telemetry.items():
        pool = state.pools.get(name)
        if pool is None or pool.spec.telemetry is None:
            continue
        for key, record in records.items():
            if record.max_running and state.now - record.at <= pool.spec.telemetry.max_age:
                out[key] = int(record.max_running)
    return out


def _fill(endpoints: Sequence[PlanEndpoint], state: PolicyState) -> float | None:
    """The mean batch fill of `endpoints` from fresh telemetry (``signals.saturation``),
    weighted by how many each pool has; None when none has a fresh record."""
    keys = {f"{e.address}:{e.port}" for e in endpoints}
    fills = []
    for name in sorted({e.pool for e in endpoints}):
        pool = state.pools.get(name)
        if pool is None or pool.spec.telemetry is None:
            continue
        members = [e for e in pool_endpoints(pool, state.registered.get(name, {})) if e.key in keys]
        value = batch_fill(
            members,
            state.telemetry.get(name, {}),
            now=state.now,
            max_age=pool.spec.telemetry.max_age,
        )
        if value is not None:
            fills.append((value, len(members)))
    if not fills:
        return None
    return round(sum(v * n for v, n in fills) / sum(n for _, n in fills), 6)


__all__ = [
    "FAR",
    "NEAR",
    "PLACE_SEPARATOR",
    "REGION",
    "SERVING",
    "batch_slots",
    "capacity",
    "capacity_parts",
    "capacity_rank",
    "fleet_view",
    "mean_load",
    "needs_view",
    "place_rank",
    "placed_views",
    "priorities",
    "spill_decision",
    "spill_key",
]
