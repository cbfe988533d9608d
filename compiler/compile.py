"""Compile policy objects and live endpoints into a routing plan (pure, no I/O).

Design choices, each forced by what Envoy does:

- One cluster per route, with failover tier k at EDS priority k. Session affinity hashes
  within one cluster only (``weighted_clusters`` picks the cluster before the hash,
  envoy#8167), so pools that share a tier, such as a 90/10 rollout, live in the same cluster
  and their split is expressed as endpoint weights. A session then stays on one side of the
  split, and retries move to the next priority with ``previous_priorities``.
- External provider pools (TLS or DNS-named endpoints) cannot join that cluster: EDS carries
  only IP addresses. Each gets a DNS cluster of its own, and a route that ends in providers
  targets an aggregate cluster: its replicas first, then the providers, in tier order.
- Compilation is best effort: a broken reference is reported as a diagnostic and everything
  else still ships.
- Routes with ``balancing: telemetry`` take their endpoint weights and DEGRADED health from
  live telemetry (``signals.weights``); every other route keeps the static weights.
- Routes of a policy with service classes take each class's admitted share from the pressure
  of their first tier's replicas (``signals.admission``); it becomes route entries (RDS).
- Telemetry routes with session affinity send their session requests to a tighter-bounded
  twin of their hash cluster while their first tier's batches are full
  (``signals.saturation``); that, too, is a route entry's cluster (RDS).
- A fleet with a locality gets its own view of each route's replicas: own zone, own region,
  other regions as EDS priorities within each tier, and capacity kinds in a pool's preferred
  order (``compiler.locality``); a saturated locality spills by its ClusterLoadAssignment's
  overprovisioning factor (``signals.spill``).
- Routes with overflow send a share of their requests to the cheapest paid pool that is not
  resting after a 429 while their first tier is saturated (``signals.overflow``): a runtime
  fraction and a cluster of route entries (RDS).

This module runs the stages in order; each lives in a module of its own: ``state`` (what
compilation reads), ``live`` (telemetry weights, admission and saturation), ``routes`` (one route's
clusters and route entry, memoised), ``fleets`` (which policies each fleet gets, and how they
share a port), ``names`` (the names of the Envoy resources). It re-exports the names callers
of compilation use with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from compiler.budgets import route_blocks
from compiler.difficulty import plan_virtual_models
from compiler.fleets import applies, fleet_compiled, fleet_names, merge_listener
from compiler.gate import auto_basis, gate_limit
from compiler.locality import (
    fleet_view,
    needs_view,
    placed_views,
    priorities,
    spill_decision,
    spill_key,
)
from compiler.memo import MemoEntry, RouteMemo
from compiler.models import served_models
from compiler.plan import (
    Diagnostic,
    FleetPlan,
    PlanCluster,
    PlanListener,
    PlanVirtualHost,
    RoutingPlan,
)
from policies.models import FleetSpec, Locality, Route, RoutingPolicy
from policies.names import cluster_name, listener_name
from signals.live import (
    admission_decisions,
    overflow_decisions,
    saturation_decisions,
    telemetry_weights,
)
from signals.saturation import SaturationDecision
from signals.spill import SpillDecision
from signals.state import PolicyState, pool_endpoints

__all__ = [
    "PolicyState",
    "RouteMemo",
    "cluster_name",
    "compile_plan",
    "listener_name",
    "pool_endpoints",
    "rollout_clusters",
]


def rollout_clusters(state: PolicyState) -> set[str]:
    """Clusters of the routes that a Rollout analyses with data-plane metrics."""
    return {
        cluster_name(rollout.spec.target.policy, rollout.spec.target.route)
        for rollout in state.rollouts.values()
        if any(rule.metric is not None for rule in rollout.spec.analysis.rules)
    }


def on_path(route: Route, decision: SaturationDecision | None) -> Route:
    """`route` as it compiles this round: a ``capacityBound`` route whose batches are too
    small for the ladder (``SaturationDecision.ladder`` false, ``signals.saturation.ladder_pays``)
    compiles as the same route without ``capacityBound``, to the fixed bounds' two twins and
    their route entries; any other route as it is."""
    affinity = route.session_affinity
    if decision is None or decision.ladder is not False or affinity is None:
        return route
    fixed = affinity.model_copy(update={"capacity_bound": False})
    return route.model_copy(update={"session_affinity": fixed})


def compile_plan(state: PolicyState, memo: RouteMemo | None = None) -> RoutingPlan:
    """Build the routing plan for every fleet. Pure: the same state gives the same plan, with
    or without `memo` (which only saves recompiling routes whose inputs did not change)."""
    diagnostics: list[Diagnostic] = []
    compiled: dict[str, tuple[list[PlanCluster], PlanVirtualHost]] = {}
    weights = telemetry_weights(state)
    memo = memo if memo is not None else RouteMemo()
    entries: dict[str, MemoEntry] = {}
    admission = admission_decisions(state)
    saturation = saturation_decisions(state)
    served = served_models(state)
    overflow = overflow_decisions(state)
    gate_auto: dict[str, tuple[int, int]] = {}
    known = set(fleet_names(state))
    for policy_name in sorted(state.policies):
        policy = state.policies[policy_name]
        policy_clusters = []
        routes = []
        for index, route in enumerate(policy.spec.routes):
            name = cluster_name(policy_name, route.name)
            saturated = saturation.get(name)
            basis = auto_basis(policy, route, state, known)
            entry = memo.route(
                policy,
                index,
                on_path(route, saturated),
                state,
                weights,
                admission.get(name),
                saturated=saturated is not None and saturated.saturated,
                served=served,
                overflow=overflow.get(name),
                bound=saturated.factor if saturated is not None else 0,
                gate=gate_limit(route, basis),
            )
            if basis is not None:
                gate_auto[name] = basis
            entries[name] = entry
            diagnostics.extend(entry.diagnostics)
            policy_clusters.extend(entry.clusters)
            routes.append(entry.route)
        if state.over_budget:
            clusters_by_route = {plan_route.short_name: plan_route.cluster for plan_route in routes}
            routes = [
                replace(plan_route, budget_blocks=blocks)
                if (
                    blocks := route_blocks(
                        plan_route, state.budgets, state.over_budget, clusters_by_route
                    )
                )
                else plan_route
                for plan_route in routes
            ]
        compiled[policy_name] = (
            policy_clusters,
            PlanVirtualHost(
                name=policy_name,
                domains=tuple(policy.spec.hosts),
                model_header=policy.spec.model_header,
                routes=tuple(routes),
                virtual_models=plan_virtual_models(
                    policy, state.difficulty, routes, policy_clusters
                ),
            ),
        )

    watched = rollout_clusters(state)
    fleets = []
    spill: dict[str, SpillDecision] = {}
    for fleet in fleet_names(state):
        in_fleet = fleet_compiled(state, fleet, compiled, weights, admission, overflow)
        fleet_object = state.fleets.get(fleet)
        settings = fleet_object.spec if fleet_object is not None else FleetSpec()
        for name, where in placed_views(fleet, settings, state):
            listeners = []
            clusters: list[PlanCluster] = []
            for port, policies in _by_port(state, fleet).items():
                vhosts, port_clusters, port_diagnostics = merge_listener(fleet, policies, in_fleet)
                feed_forward = where is not None and settings.spill_signal == "arrivals"
                if where is not None or any(p.spec.prefer_capacity for p in state.pools.values()):
                    port_clusters, vhosts = _fleet_views(
                        name, where, port_clusters, vhosts, state, spill, feed_forward
                    )
                diagnostics.extend(port_diagnostics)
                clusters.extend(port_clusters)
                listeners.append(
                    PlanListener(
                        name=listener_name(port),
                        address=policies[0].spec.listener.address,
                        port=port,
                        virtual_hosts=tuple(vhosts),
                        max_request_body_bytes=settings.max_request_body_bytes,
                        access_log=settings.access_log,
                        drain_timeout=settings.drain_timeout,
                        # Rollouts read every attempt; overflow learns which paid pool
                        # answered 429 and for how long (its Retry-After).
                        upstream_signals=any(
                            route.cluster in watched or route.overflow is not None
                            for vhost in vhosts
                            for route in vhost.routes
                        ),
                        # A located fleet's spill reads its Envoys' request starts. Not
                        # tied to how many priorities there are now: a listener change
                        # drains the listener's connections.
                        arrivals_log=(feed_forward and any(c.kind == "eds" for c in port_clusters))
                        # Overflow that follows the route's arrival rate reads them too.
                        or any(
                            route.overflow is not None and route.overflow.arrivals
                            for vhost in vhosts
                            for route in vhost.routes
                        ),
                        tracing=settings.tracing,
                    )
                )
            fleets.append(
                FleetPlan(
                    fleet=name,
                    listeners=tuple(listeners),
                    clusters=tuple(clusters),
                    secrets_dir=settings.secrets_dir,
                    trusted_ca_file=settings.trusted_ca_file,
                    tracing=settings.tracing,
                )
            )
    memo.keep(entries)
    return RoutingPlan(
        fleets=tuple(fleets),
        diagnostics=_dedupe(diagnostics),
        weights=weights,
        admission=admission,
        saturation=saturation,
        difficulty=state.difficulty,
        spill=spill,
        gate_auto=gate_auto,
        overflow=overflow,
    )


def _by_port(state: PolicyState, fleet: str) -> dict[int, list[RoutingPolicy]]:
    """The policies `fleet` gets, by listener port, ports and policies in name order."""
    by_port: dict[int, list[RoutingPolicy]] = {}
    for policy_name in sorted(state.policies):
        policy = state.policies[policy_name]
        if applies(policy, fleet):
            by_port.setdefault(policy.spec.listener.port, []).append(policy)
    return dict(sorted(by_port.items()))


def _fleet_views(
    fleet: str,
    where: Locality | None,
    clusters: list[PlanCluster],
    vhosts: list[PlanVirtualHost],
    state: PolicyState,
    spill: dict[str, SpillDecision],
    feed_forward: bool = True,
) -> tuple[list[PlanCluster], list[PlanVirtualHost]]:
    """The clusters of one listener as `fleet` (at `where`) gets them, with each spill
    decision recorded in `spill`; the routes whose cluster now has several priorities retry
    on the next one (``previous_priorities``), as between tiers."""
    out: list[PlanCluster] = []
    levels: dict[str, int] = {}
    for cluster in clusters:
        if not needs_view(cluster, where, state.pools):
            out.append(cluster)
            continue
        view = fleet_view(cluster, where, state.pools)
        count = priorities(view)
        decision = spill_decision(fleet, cluster, view, where, state, feed_forward=feed_forward)
        spill[spill_key(fleet, view.eds_service or view.name)] = decision
        if count > 1 and decision.keep < 1.0:
            # With one priority there is nowhere to spill to: Envoy's default stays.
            view = replace(view, overprovisioning=decision.overprovisioning)
        levels[view.eds_service or view.name] = count
        out.append(view)
    if not any(count > 1 for count in levels.values()):
        return out, vhosts
    views = []
    for vhost in vhosts:
        routes = tuple(
            replace(route, tiers=max(route.tiers, levels.get(route.cluster, 0)))
            for route in vhost.routes
        )
        views.append(replace(vhost, routes=routes) if routes != vhost.routes else vhost)
    return out, views


def _dedupe(diagnostics: Iterable[Diagnostic]) -> tuple[Diagnostic, ...]:
    return tuple(dict.fromkeys(diagnostics))
