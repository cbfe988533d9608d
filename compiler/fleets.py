"""Which fleets get a config, which policies each fleet gets (with that fleet's own tier
weights, for a canary fleet), and how the policies on one port share its listener."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from compiler.gate import auto_basis, gate_limit
from compiler.plan import DEFAULT_FLEET, Diagnostic, PlanCluster, PlanVirtualHost
from compiler.routes import compile_route
from policies.models import RoutingPolicy
from policies.names import cluster_name
from signals.admission import AdmissionDecision
from signals.overflow import OverflowDecision
from signals.state import PolicyState
from signals.weights import WeightDecision


def fleet_names(state: PolicyState) -> list[str]:
    """Every fleet that gets its own config: named by a policy or a Fleet object, plus default."""
    names = {DEFAULT_FLEET, *state.fleets}
    for policy in state.policies.values():
        names.update(fleet for fleet in policy.spec.fleets if fleet != "*")
    return sorted(names)


def applies(policy: RoutingPolicy, fleet: str) -> bool:
    return "*" in policy.spec.fleets or fleet in policy.spec.fleets


def fleet_weighted(policy: RoutingPolicy) -> set[str]:
    """Fleets for which some tier of ``policy`` has weights of their own (``fleetWeights``)."""
    return {
        fleet
        for route in policy.spec.routes
        for tier in route.tiers
        for fleet in tier.fleet_weights
    }


def policy_in(policy: RoutingPolicy, fleet: str) -> RoutingPolicy:
    """``policy`` as the Envoys of ``fleet`` get it: each tier with that fleet's weights."""
    routes = [
        route.model_copy(update={"tiers": [tier.weights_in(fleet) for tier in route.tiers]})
        for route in policy.spec.routes
    ]
    spec = policy.spec.model_copy(update={"routes": routes})
    return policy.model_copy(update={"spec": spec})


def fleet_compiled(
    state: PolicyState,
    fleet: str,
    compiled: Mapping[str, tuple[list[PlanCluster], PlanVirtualHost]],
    weights: Mapping[str, Mapping[str, WeightDecision]],
    admission: Mapping[str, AdmissionDecision],
    overflow: Mapping[str, OverflowDecision] | None = None,
) -> Mapping[str, tuple[list[PlanCluster], PlanVirtualHost]]:
    """``compiled``, with the policies whose tiers weigh pools differently in ``fleet``
    compiled again as that fleet gets them (a rollout's canary fleet; rare and short-lived,
    so not memoised)."""
    out = dict(compiled)
    known = set(fleet_names(state))
    for name, policy in state.policies.items():
        if fleet not in fleet_weighted(policy) or not applies(policy, fleet):
            continue
        variant = policy_in(policy, fleet)
        clusters: list[PlanCluster] = []
        routes = []
        for route in variant.spec.routes:
            key = cluster_name(name, route.name)
            route_clusters, plan_route = compile_route(
                variant,
                route,
                state,
                weights,
                admission.get(key),
                overflow=(overflow or {}).get(key),
                gate=gate_limit(route, auto_basis(variant, route, state, known)),
            )
            clusters.extend(route_clusters)
            routes.append(plan_route)
        out[name] = (clusters, replace(compiled[name][1], routes=tuple(routes)))
    return out


def merge_listener(
    fleet: str,
    policies: list[RoutingPolicy],
    compiled: Mapping[str, tuple[list[PlanCluster], PlanVirtualHost]],
) -> tuple[list[PlanVirtualHost], list[PlanCluster], list[Diagnostic]]:
    """Put several policies on one port; a policy whose host names are taken is left out."""
    vhosts: list[PlanVirtualHost] = []
    clusters: list[PlanCluster] = []
    diagnostics: list[Diagnostic] = []
    owner: dict[str, str] = {}
    for policy in policies:
        name = policy.metadata.name
        taken = [domain for domain in policy.spec.hosts if domain in owner]
        if taken:
            diagnostics.append(
                Diagnostic(
                    "error",
                    "RoutingPolicy",
                    name,
                    f"host {taken[0]!r} on port {policy.spec.listener.port} already belongs to "
                    f"policy {owner[taken[0]]!r} in fleet {fleet!r}; this policy is not applied "
                    "there",
                    "spec.hosts",
                )
            )
            continue
        owner.update(dict.fromkeys(policy.spec.hosts, name))
        policy_clusters, vhost = compiled[name]
        vhosts.append(vhost)
        clusters.extend(policy_clusters)
    return vhosts, clusters, diagnostics
