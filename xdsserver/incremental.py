"""A fleet's next snapshot, built from the one it is served now with only what changed.

Every rebuild compiles the whole plan, then translates and serializes only what the change
needs: when a fleet's new plan differs from the last one only in the endpoints of some
clusters (registrations, weights, health, telemetry), only those ClusterLoadAssignments (the
EDS fast path); when its clusters are unchanged, only its listeners and route configurations
(the routes path); otherwise everything. Pure: plans and snapshots in, a snapshot out.
"""

from __future__ import annotations

from dataclasses import replace

from compiler import FleetPlan
from compiler.plan import PlanEscalation, PlanScorerService
from xdsserver import resources
from xdsserver.snapshot import Snapshot
from xdsserver.translate import (
    translate,
    translate_endpoints,
    translate_listeners,
    translate_routes,
)

BUILD_PATHS = ("fast", "routes", "full")
"""How a rebuild made a fleet's snapshot, cheapest first: ``fast`` translates only changed
ClusterLoadAssignments, ``routes`` only listeners and route configurations, ``full`` all."""


def build_snapshot(
    fleet: FleetPlan, old: FleetPlan | None, before: Snapshot | None
) -> tuple[Snapshot, str]:
    """`fleet`'s snapshot and the path (``BUILD_PATHS``) that made it, reusing what it can of
    `before`, the snapshot built from `old` (None for either: translate everything)."""
    snapshot, path = _partial(fleet, old, before)
    if snapshot is None:
        snapshot = Snapshot.from_messages(translate(fleet).by_type())
    return snapshot, path


def _partial(
    fleet: FleetPlan, old: FleetPlan | None, before: Snapshot | None
) -> tuple[Snapshot | None, str]:
    """The cheapest way to this fleet's new snapshot from the one it is served now: the
    snapshot and its path, or (None, "full") when everything must be translated. A partial
    path applies only when every part of the plan other than the one it translates is
    equal to the last plan's, so a field added to FleetPlan later cannot go stale."""
    if old is None or before is None:
        return None, "full"
    if replace(fleet, clusters=old.clusters) == old:
        snapshot = _endpoints_only(fleet, old, before)
        if snapshot is not None:
            return snapshot, "fast"
    if replace(fleet, listeners=old.listeners) == old and _services(fleet) == _services(old):
        return _routes_only(fleet, before), "routes"
    return None, "full"


def _endpoints_only(fleet: FleetPlan, old: FleetPlan, before: Snapshot) -> Snapshot | None:
    """The fast path, for a plan that differs from `old` in its clusters alone: when only
    the endpoints of EDS clusters changed (registrations, weights, health, telemetry),
    translate and serialize just those ClusterLoadAssignments and reuse everything else.
    None when anything else changed."""
    previous = {cluster.name: cluster for cluster in old.clusters}
    if list(previous) != [cluster.name for cluster in fleet.clusters]:
        return None
    # Compilation keeps the very object of an unchanged route's cluster: identity first, so
    # an endpoint change does not compare the fleet's endpoints.
    changed = [
        cluster
        for cluster in fleet.clusters
        if previous[cluster.name] is not cluster and previous[cluster.name] != cluster
    ]
    for cluster in changed:
        if (
            cluster.kind not in ("eds", "gate")
            or replace(previous[cluster.name], endpoints=cluster.endpoints) != cluster
        ):
            return None
    if not changed:
        return before
    return before.with_messages(
        resources.ENDPOINT,
        # A gate reads its replicas' own assignment (``eds_service``), changed beside it.
        [translate_endpoints(cluster) for cluster in changed if cluster.kind == "eds"],
        replace_all=False,
    )


def _routes_only(fleet: FleetPlan, before: Snapshot) -> Snapshot:
    """The routes path, for a plan whose clusters are what they were (a timeout, a match, a
    rate limit changed): translate LDS and RDS and reuse every Cluster and
    ClusterLoadAssignment, which dominate at scale."""
    return before.with_messages(
        resources.LISTENER, translate_listeners(fleet), replace_all=True
    ).with_messages(resources.ROUTE, translate_routes(fleet), replace_all=True)


def _services(fleet: FleetPlan) -> list[tuple[PlanScorerService | None, PlanEscalation | None]]:
    """Virtual models' classifiers and escalations: their clusters come from the listeners'
    plan (CDS)."""
    return [
        (virtual.service, virtual.escalation)
        for listener in fleet.listeners
        for vhost in listener.virtual_hosts
        for virtual in vhost.virtual_models
    ]
