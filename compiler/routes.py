"""Compile one route: its clusters (one EDS cluster with failover tier k at priority k, a DNS
cluster per external provider, an aggregate over them, and its paid overflow pools), its route
entry with its service classes, and its diagnostics (``compiler.memo`` reuses a compiled route
while its inputs are unchanged)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from compiler.gate import gate_clusters
from compiler.models import NO_MODELS, PoolModels
from compiler.plan import (
    Diagnostic,
    PlanClass,
    PlanCluster,
    PlanEndpoint,
    PlanOverflow,
    PlanRoute,
)
from policies.models import (
    ClassQueue,
    Pool,
    PoolSpec,
    Route,
    RoutingPolicy,
    Tier,
)
from policies.models.classes import DEFAULT_TENANT_HEADER
from policies.names import (
    LOCAL_SUFFIX,
    cluster_name,
    overflow_cluster_name,
    provider_cluster_name,
    queue_cluster_name,
)
from signals.admission import AdmissionDecision
from signals.overflow import OverflowDecision, provider_order
from signals.state import PolicyState, is_external, pool_endpoints
from signals.weights import WeightDecision

SPLIT_SCALE = 100
"""Resolution of a split: a pool's endpoints share ``pool weight x SPLIT_SCALE`` weight units."""


def _plan_classes(
    policy: RoutingPolicy, route: Route, admission: AdmissionDecision | None
) -> tuple[PlanClass, ...]:
    """The route's classes in the order Envoy tries them: those with a match, most important
    first, then the route's fallback class (its serviceClass, else the policy's default)."""
    classes = policy.spec.service_classes
    if classes is None:
        return ()
    decision = admission or AdmissionDecision()

    def plan_class(index: int, *, fallback: bool) -> PlanClass:
        service_class = classes.classes[index]
        match = service_class.match
        divert = service_class.divert_to
        action = service_class.when_saturated
        if divert == route.name:
            # A route cannot divert to itself: this class is what it takes in.
            action, divert = "admit", None
        target = cluster_name(policy.metadata.name, divert) if divert else ""
        if action == "queue":
            target = queue_cluster_name(
                cluster_name(policy.metadata.name, route.name), service_class.name
            )
        return PlanClass(
            name=service_class.name,
            headers=()
            if fallback or match is None
            else tuple((h.name, h.value) for h in match.headers),
            tenants=() if fallback or match is None else tuple(match.tenants),
            action=action,
            admitted=decision.share(service_class.name) if action != "admit" else 1.0,
            retry_after=max(1, math.ceil(service_class.retry_after)),
            target_cluster=target,
            budget=service_class.budget,
        )

    names = classes.names()
    matched = [plan_class(i, fallback=False) for i, c in enumerate(classes.classes) if c.match]
    fallback = plan_class(names.index(route.service_class or classes.default), fallback=True)
    return (*matched, fallback)


def _tier_endpoints(
    tier: Tier,
    priority: int,
    state: PolicyState,
    weights: Mapping[str, Mapping[str, WeightDecision]],
    served: Mapping[str, PoolModels] | None = None,
) -> list[PlanEndpoint]:
    """The endpoints of one tier; with ``served`` (a cluster that routes by model), each
    carries the models it serves."""
    members = []
    for target in tier.pools:
        pool = state.pools.get(target.pool)
        if pool is None or target.weight == 0 or is_external(pool):
            continue
        endpoints = pool_endpoints(pool, state.registered.get(target.pool, {}))
        decisions = weights.get(target.pool)
        # (endpoint, weight, health): telemetry decisions override the registered values.
        rows = [
            (endpoint, endpoint.weight, endpoint.health)
            if decisions is None or (decision := decisions.get(endpoint.key)) is None
            else (endpoint, decision.weight, "degraded" if decision.degraded else endpoint.health)
            for endpoint in endpoints
        ]
        if rows:
            members.append((target.weight, pool, rows))
    out: list[PlanEndpoint] = []
    single = len(members) == 1
    for pool_weight, pool, rows in members:
        total = sum(weight for _, weight, _ in rows)
        name = pool.metadata.name
        hostname = pool.spec.host_rewrite or ""
        models = served.get(name, NO_MODELS) if served is not None else None
        # Positional, in one comprehension: this runs once per endpoint and route.
        out.extend(
            PlanEndpoint(
                name,
                endpoint.address,
                endpoint.port,
                weight if single else max(1, round(weight * pool_weight * SPLIT_SCALE / total)),
                priority,
                health,
                endpoint.locality.region if endpoint.locality else "",
                endpoint.locality.zone if endpoint.locality else "",
                hostname,
                endpoint.name or "",
                ()
                if models is None
                else models.models
                if models.static
                else models.by_endpoint.get(endpoint.key, ()),
                endpoint.capacity or "",
            )
            for endpoint, weight, health in rows
        )
    return out


def route_diagnostics(
    policy: RoutingPolicy, index: int, route: Route, state: PolicyState
) -> list[Diagnostic]:
    name = policy.metadata.name
    out = []
    protocols = set()
    seen_external = False
    for tier_index, tier in enumerate(route.tiers):
        for pool_index, target in enumerate(tier.pools):
            path = f"spec.routes[{index}].tiers[{tier_index}].pools[{pool_index}]"
            pool = state.pools.get(target.pool)
            if pool is None:
                out.append(
                    Diagnostic(
                        "warning",
                        "RoutingPolicy",
                        name,
                        f"pool {target.pool!r} does not exist (yet); route {route.name!r} "
                        "skips it until it is created",
                        path,
                    )
                )
                continue
            if is_external(pool):
                seen_external = True
            else:
                protocols.add(pool.spec.protocol)
                if seen_external:
                    out.append(
                        Diagnostic(
                            "warning",
                            "RoutingPolicy",
                            name,
                            f"pool {target.pool!r} follows an external provider pool; replicas "
                            "are always tried before external providers, in tier order",
                            path,
                        )
                    )
            if not pool.spec.endpoints and not state.registered.get(target.pool):
                out.append(
                    Diagnostic(
                        "warning",
                        "RoutingPolicy",
                        name,
                        f"pool {target.pool!r} has no endpoints",
                        path,
                    )
                )
    if route.overflow is not None:
        for pool_index, pool_name in enumerate(route.overflow.pools):
            path = f"spec.routes[{index}].overflow.pools[{pool_index}]"
            paid = state.pools.get(pool_name)
            if paid is None:
                message = f"pool {pool_name!r} does not exist (yet); overflow skips it"
            elif not is_external(paid):
                message = (
                    f"pool {pool_name!r} is not an external provider (TLS or DNS-named "
                    "endpoints); overflow skips it"
                )
            else:
                continue
            out.append(Diagnostic("warning", "RoutingPolicy", name, message, path))
    if len(protocols) > 1:
        out.append(
            Diagnostic(
                "error",
                "RoutingPolicy",
                name,
                f"route {route.name!r} mixes http1 and http2 pools; one Envoy cluster speaks "
                "one protocol, so the first tier's protocol is used",
                f"spec.routes[{index}]",
            )
        )
    return out


def _cluster(
    name: str,
    route: Route,
    spec: PoolSpec,
    endpoints: Iterable[PlanEndpoint],
    **extra: Any,
) -> PlanCluster:
    return PlanCluster(
        name=name,
        protocol=spec.protocol,
        balancing=route.balancing,
        affinity=route.session_affinity,
        connect_timeout=spec.connect_timeout,
        health_check=spec.health_check,
        outlier_detection=spec.outlier_detection,
        circuit_breakers=spec.circuit_breakers,
        tls=spec.tls,
        auth=spec.auth,
        endpoints=tuple(endpoints),
        **extra,
    )


def _provider_cluster(name: str, route: Route, pool: Pool, state: PolicyState) -> PlanCluster:
    endpoints = [
        PlanEndpoint(
            pool=pool.metadata.name,
            address=endpoint.address,
            port=endpoint.port,
            weight=endpoint.weight,
            priority=0,
            health=endpoint.health,
            hostname=pool.spec.host_rewrite or endpoint.address,
        )
        for endpoint in pool_endpoints(pool, state.registered.get(pool.metadata.name, {}))
    ]
    # Hashing does not apply to a provider: it keeps its own cache.
    cluster = _cluster(name, route, pool.spec, endpoints, kind="dns")
    return replace(cluster, affinity=None, balancing="round_robin")


def compile_route(
    policy: RoutingPolicy,
    route: Route,
    state: PolicyState,
    weights: Mapping[str, Mapping[str, WeightDecision]],
    admission: AdmissionDecision | None = None,
    *,
    saturated: bool = False,
    served: Mapping[str, PoolModels] | None = None,
    overflow: OverflowDecision | None = None,
    bound: int = 0,
    gate: int | None,
) -> tuple[list[PlanCluster], PlanRoute]:
    """The clusters of one route and its route entry (`gate`: the gate's limit per Envoy,
    ``compiler.gate.gate_limit``).

    Replicas (IP endpoints) of every tier go into one EDS cluster at priority = tier. External
    provider pools get a DNS cluster each; when a route has any, an aggregate cluster puts the
    replicas first and the providers after them, in tier order. A route with overflow gets its
    paid pools' clusters and one aggregate per paid pool (``_overflow_clusters``); which one
    its overflow takes, and how much, is the route entry's (`overflow`, RDS alone).
    """
    name = cluster_name(policy.metadata.name, route.name)
    route_weights = weights if route.balancing == "telemetry" else {}
    served = served or {}
    pools_served = [
        served[target.pool]
        for tier in route.tiers
        for target in tier.pools
        if target.pool in served
    ]
    # Adapter-aware routing needs what replicas report: a route whose pools all list their
    # models has nothing to choose between.
    subsets = (
        route.adapters.affinity
        and route.balancing != "orca"
        and any(not models.static for models in pools_served)
    )
    endpoints: list[PlanEndpoint] = []
    providers: list[Pool] = []
    for priority, tier in enumerate(route.tiers):
        endpoints.extend(
            _tier_endpoints(tier, priority, state, route_weights, served if subsets else None)
        )
        providers.extend(
            pool
            for target in tier.pools
            if (pool := state.pools.get(target.pool)) is not None
            and is_external(pool)
            and target.weight > 0
        )
    local = [
        state.pools[target.pool]
        for tier in route.tiers
        for target in tier.pools
        if target.pool in state.pools and not is_external(state.pools[target.pool])
    ]
    # Cluster-wide settings of the replicas' cluster come from the first pool, tier 0 first.
    spec = local[0].spec if local else PoolSpec()
    uses_hostname = any(pool.spec.host_rewrite for pool in local) or bool(providers)
    offered = {model for models in pools_served for model in models.served}
    models = _route_models(route, offered, discovered=any(not m.static for m in pools_served))
    static_models = {
        model
        for tier in route.tiers
        for target in tier.pools
        if (pool := state.pools.get(target.pool)) is not None
        for model in pool.spec.models
    }
    listed = set(models) or (static_models if static_models or route.match.models else offered)
    parents = dict(pair for models_ in pools_served for pair in models_.parents)
    plan_route = PlanRoute(
        name=name,
        cluster=name,
        models=models,
        path_prefix=route.match.path_prefix,
        headers=tuple((header.name, header.value) for header in route.match.headers),
        affinity=route.session_affinity,
        retries=route.retries,
        timeouts=route.timeouts,
        rate_limit=route.rate_limit,
        host_rewrite=uses_hostname,
        tiers=len(route.tiers),
        served_models=tuple(sorted(listed)),
        classes=_plan_classes(policy, route, admission),
        tenant_header=policy.spec.service_classes.tenant_header
        if policy.spec.service_classes is not None
        else DEFAULT_TENANT_HEADER,
        saturated=saturated,
        model_subsets=subsets,
        # A pool that lists its models has no adapters to fall back for.
        any_model=route.match.pool_models
        and route.adapters.fallback == "base"
        and any(
            not (target.pool in served and served[target.pool].static)
            for tier in route.tiers
            for target in tier.pools
        ),
        adapters=tuple(sorted((a, p) for a, p in parents.items() if a in listed)),
        pools=tuple(target.pool for tier in route.tiers for target in tier.pools),
        bound=bound,
    )
    classes = policy.spec.service_classes
    queues = tuple(
        (queue_cluster_name(name, c.name), c.queue or ClassQueue())
        for c in (classes.queued if classes is not None else [])
    )
    if not providers:
        out = [_cluster(name, route, spec, endpoints, queues=queues, model_subsets=subsets)]
        replicas = name
    else:
        members: list[str] = []
        clusters: list[PlanCluster] = []
        if local:
            local_name = name + LOCAL_SUFFIX
            clusters.append(
                _cluster(
                    local_name,
                    route,
                    spec,
                    endpoints,
                    eds_service=name,
                    queues=queues,
                    model_subsets=subsets,
                )
            )
            members.append(local_name)
        for pool in providers:
            provider = _provider_cluster(
                provider_cluster_name(name, pool.metadata.name), route, pool, state
            )
            clusters.append(provider)
            members.append(provider.name)
        aggregate = _cluster(name, route, spec, (), kind="aggregate", members=tuple(members))
        out = [aggregate, *clusters]
        replicas = name + LOCAL_SUFFIX if local else ""
    if route.overflow is None:
        return out, plan_route
    paid, plan_overflow = _overflow_clusters(
        name, route, spec, state, replicas, {p.metadata.name for p in providers}, overflow
    )
    gates = gate_clusters(name, route, [*out, *paid], replicas, subsets, gate)
    if gates:
        plan_overflow = replace(
            plan_overflow,
            gate=gates[0].name,
            gate_conversations=route.overflow.conversations == "with",
        )
    return [*out, *paid, *gates], replace(plan_route, overflow=plan_overflow)


def _overflow_clusters(
    name: str,
    route: Route,
    spec: PoolSpec,
    state: PolicyState,
    replicas: str,
    in_tiers: set[str],
    decision: OverflowDecision | None,
) -> tuple[list[PlanCluster], PlanOverflow]:
    """A route's paid pools: a DNS cluster each, and for each an aggregate that starts from
    it, goes on to the other paid pools (cheapest first) and ends at the route's replicas, so
    a request that one refuses (a 429) is retried on the next. Every paid pool has its
    aggregate whether it takes overflow now or not: moving the overflow to another pool, or
    stopping it, is then a route change alone (RDS), never a cluster change."""
    assert route.overflow is not None
    order = [
        pool
        for pool in provider_order(route.overflow, state.pools)
        if is_external(state.pools[pool])
    ]
    clusters = [
        _provider_cluster(provider_cluster_name(name, pool), route, state.pools[pool], state)
        for pool in order
        if pool not in in_tiers
    ]
    for first in order:
        members = [provider_cluster_name(name, first)]
        members += [provider_cluster_name(name, pool) for pool in order if pool != first]
        members += [replicas] if replicas else []
        aggregate = _cluster(
            overflow_cluster_name(name, first),
            route,
            spec,
            (),
            kind="aggregate",
            members=tuple(members),
        )
        clusters.append(replace(aggregate, affinity=None))
    decision = decision or OverflowDecision()
    chosen = decision.provider if decision.provider in order else ""
    plan_overflow = PlanOverflow(
        cluster=overflow_cluster_name(name, chosen) if chosen else "",
        plain=decision.plain if chosen else 0.0,
        sessions=decision.sessions if chosen else 0.0,
        members=len(order) + (1 if replicas else 0),
        arrivals=route.overflow.signal == "arrivals",
    )
    return clusters, plan_overflow


def _route_models(route: Route, offered: set[str], *, discovered: bool) -> tuple[str, ...]:
    """The models a route's entries match: its own list, or with ``poolModels`` what its
    pools serve. With fallback ``notFound``, a listed model that no replica reports is left
    out (Envoy then answers 404) once replicas report anything."""
    if route.match.pool_models:
        return tuple(sorted(offered))
    models = tuple(route.match.models)
    if route.adapters.fallback == "notFound" and discovered:
        models = tuple(model for model in models if model in offered)
    return models
