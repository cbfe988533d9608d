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

from compiler.difficulty import plan_virtual_models
from compiler.fleets import applies, fleet_compiled, fleet_names, merge_listener
from compiler.plan import (
    Diagnostic,
    FleetPlan,
    PlanCluster,
    PlanListener,
    PlanVirtualHost,
    RoutingPlan,
)
from compiler.routes import MemoEntry, RouteMemo
from policies.models import FleetSpec, RoutingPolicy
from policies.names import cluster_name, listener_name
from signals.live import (
    admission_decisions,
    overflow_decisions,
    saturation_decisions,
    telemetry_weights,
)
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
    overflow = overflow_decisions(state)
    for policy_name in sorted(state.policies):
        policy = state.policies[policy_name]
        policy_clusters = []
        routes = []
        for index, route in enumerate(policy.spec.routes):
            name = cluster_name(policy_name, route.name)
            saturated = saturation.get(name)
            entry = memo.route(
                policy,
                index,
                route,
                state,
                weights,
                admission.get(name),
                saturated=saturated is not None and saturated.saturated,
                overflow=overflow.get(name),
            )
            entries[name] = entry
            diagnostics.extend(entry.diagnostics)
            policy_clusters.extend(entry.clusters)
            routes.append(entry.route)
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
    for fleet in fleet_names(state):
        in_fleet = fleet_compiled(state, fleet, compiled, weights, admission, overflow)
        fleet_object = state.fleets.get(fleet)
        settings = fleet_object.spec if fleet_object is not None else FleetSpec()
        by_port: dict[int, list[RoutingPolicy]] = {}
        for policy_name in sorted(state.policies):
            policy = state.policies[policy_name]
            if applies(policy, fleet):
                by_port.setdefault(policy.spec.listener.port, []).append(policy)
        listeners = []
        clusters: list[PlanCluster] = []
        for port in sorted(by_port):
            vhosts, port_clusters, port_diagnostics = merge_listener(fleet, by_port[port], in_fleet)
            diagnostics.extend(port_diagnostics)
            clusters.extend(port_clusters)
            listeners.append(
                PlanListener(
                    name=listener_name(port),
                    address=by_port[port][0].spec.listener.address,
                    port=port,
                    virtual_hosts=tuple(vhosts),
                    max_request_body_bytes=settings.max_request_body_bytes,
                    access_log=settings.access_log,
                    drain_timeout=settings.drain_timeout,
                    # Rollouts read every attempt; overflow learns which paid pool answered
                    # 429 and for how long (its Retry-After).
                    upstream_signals=any(
                        route.cluster in watched or route.overflow is not None
                        for vhost in vhosts
                        for route in vhost.routes
                    ),
                )
            )
        fleets.append(
            FleetPlan(
                fleet=fleet,
                listeners=tuple(listeners),
                clusters=tuple(clusters),
                secrets_dir=settings.secrets_dir,
                trusted_ca_file=settings.trusted_ca_file,
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
        overflow=overflow,
    )


def _dedupe(diagnostics: Iterable[Diagnostic]) -> tuple[Diagnostic, ...]:
    return tuple(dict.fromkeys(diagnostics))
