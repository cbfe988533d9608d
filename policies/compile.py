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
  live telemetry (``policies.weights``); every other route keeps the static weights.
- Routes of a policy with service classes take each class's admitted share from the pressure
  of their first tier's replicas (``policies.admission``); it becomes route entries (RDS).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from policies.admission import AdmissionDecision, decide, pool_signals, pressure_of
from policies.models import (
    ClassQueue,
    Endpoint,
    Fleet,
    FleetSpec,
    PolicyObject,
    Pool,
    PoolSpec,
    Rollout,
    Route,
    RoutingPolicy,
    SessionAffinity,
    Tier,
)
from policies.plan import (
    DEFAULT_FLEET,
    Diagnostic,
    FleetPlan,
    PlanClass,
    PlanCluster,
    PlanEndpoint,
    PlanListener,
    PlanRoute,
    PlanVirtualHost,
    RoutingPlan,
)
from policies.telemetry import TelemetryRecord
from policies.weights import WeightDecision, WeightParams, balance_factor, pool_weights

LOCAL_SUFFIX = "/local"
"""Suffix of the replicas' cluster of a route whose aggregate cluster also has providers."""
QUEUE_INFIX = "/queue/"
"""Between a route's cluster name and a class name: the cluster that queues that class."""
SPLIT_SCALE = 100
"""Resolution of a split: a pool's endpoints share ``pool weight x SPLIT_SCALE`` weight units."""


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Everything compilation needs, already validated."""

    pools: Mapping[str, Pool] = field(default_factory=dict)
    policies: Mapping[str, RoutingPolicy] = field(default_factory=dict)
    fleets: Mapping[str, Fleet] = field(default_factory=dict)
    registered: Mapping[str, Mapping[str, Endpoint]] = field(default_factory=dict)
    """Endpoints registered through the API or by agents: pool name -> endpoint id -> endpoint."""
    telemetry: Mapping[str, Mapping[str, TelemetryRecord]] = field(default_factory=dict)
    """Latest telemetry: pool name -> endpoint id (``address:port``) -> record."""
    previous_weights: Mapping[str, Mapping[str, WeightDecision]] = field(default_factory=dict)
    """``RoutingPlan.weights`` of the previous compile, for hysteresis."""
    previous_admission: Mapping[str, AdmissionDecision] = field(default_factory=dict)
    """``RoutingPlan.admission`` of the previous compile, for hysteresis."""
    now: float = 0.0
    """Wall-clock seconds that telemetry ages are measured against."""
    rollouts: Mapping[str, Rollout] = field(default_factory=dict)
    """Rollouts: their routes' listeners report every upstream attempt to kvpilot."""

    @classmethod
    def from_objects(cls, objects: Iterable[PolicyObject], **live: Any) -> PolicyState:
        """File validated objects by kind (a later object replaces an earlier one of the same
        kind and name); ``live`` gives the other fields (registered endpoints, telemetry...)."""
        by_kind: dict[type[PolicyObject], dict[str, Any]] = {
            Pool: {},
            RoutingPolicy: {},
            Fleet: {},
            Rollout: {},
        }
        for obj in objects:
            by_kind[type(obj)][obj.metadata.name] = obj
        return cls(
            pools=by_kind[Pool],
            policies=by_kind[RoutingPolicy],
            fleets=by_kind[Fleet],
            rollouts=by_kind[Rollout],
            **live,
        )


def cluster_name(policy: str, route: str) -> str:
    """The Envoy cluster of one route."""
    return f"{policy}/{route}"


def queue_cluster_name(route_cluster: str, service_class: str) -> str:
    """The cluster whose circuit breakers queue one class of one route."""
    return f"{route_cluster}{QUEUE_INFIX}{service_class}"


def listener_name(port: int) -> str:
    """The Envoy listener (and route configuration) for one port."""
    return f"listener-{port}"


def is_external(pool: Pool) -> bool:
    """An external provider pool (``PoolSpec.external``): TLS or DNS-named endpoints."""
    return pool.spec.external


def pool_endpoints(pool: Pool, registered: Mapping[str, Endpoint]) -> list[Endpoint]:
    """Static endpoints of a pool plus registered ones; a registration overrides a static entry
    with the same address and port."""
    static = pool.spec.by_key
    if not registered:
        return list(static.values())
    merged = dict(static)
    for endpoint in registered.values():
        merged[endpoint.key] = endpoint
    return [merged[key] for key in sorted(merged)]


def telemetry_weights(state: PolicyState) -> dict[str, dict[str, WeightDecision]]:
    """Weights from telemetry for every pool that a ``balancing: telemetry`` route uses: pool
    name -> endpoint key -> decision. A pool behind session affinity in any such route is
    quantized coarsely (it shares one ClusterLoadAssignment with its hash cluster)."""
    affinity: dict[str, bool] = {}
    for policy in state.policies.values():
        for route in policy.spec.routes:
            if route.balancing != "telemetry":
                continue
            for tier in route.tiers:
                for target in tier.pools:
                    affinity[target.pool] = affinity.get(target.pool, False) or (
                        route.session_affinity is not None
                    )
    out: dict[str, dict[str, WeightDecision]] = {}
    for name in sorted(affinity):
        pool = state.pools.get(name)
        if pool is None:
            continue
        source = pool.spec.telemetry
        out[name] = pool_weights(
            pool_endpoints(pool, state.registered.get(name, {})),
            state.telemetry.get(name, {}),
            now=state.now,
            previous=state.previous_weights.get(name, {}),
            params=WeightParams(max_age=source.max_age) if source else WeightParams(),
            affinity=affinity[name],
        )
    return out


DEFAULT_MAX_AGE = 10.0
"""Telemetry age limit of a pool without a ``telemetry`` section (TelemetrySource's default)."""


def admission_decisions(state: PolicyState) -> dict[str, AdmissionDecision]:
    """Admission for every route of every policy with service classes: route cluster name
    (``policy/route``) -> decision, from the pressure of the route's first-tier replicas."""
    out: dict[str, AdmissionDecision] = {}
    for policy_name in sorted(state.policies):
        spec = state.policies[policy_name].spec
        classes = spec.service_classes
        if classes is None:
            continue
        for route in spec.routes:
            endpoints: list[Endpoint] = []
            telemetry: dict[str, TelemetryRecord] = {}
            max_age = DEFAULT_MAX_AGE
            for target in route.tiers[0].pools:
                pool = state.pools.get(target.pool)
                if pool is None or is_external(pool) or target.weight == 0:
                    continue
                endpoints.extend(pool_endpoints(pool, state.registered.get(target.pool, {})))
                telemetry.update(state.telemetry.get(target.pool, {}))
                if pool.spec.telemetry is not None:
                    max_age = min(max_age, pool.spec.telemetry.max_age)
            signals = pool_signals(
                endpoints,
                telemetry,
                now=state.now,
                max_age=max_age,
                saturation=classes.saturation,
                ttft_bound=classes.ttft_bound,
            )
            name = cluster_name(policy_name, route.name)
            out[name] = decide(
                state.previous_admission.get(name),
                pressure_of(signals),
                classes.classes,
                now=state.now,
                saturation=classes.saturation,
                signals=signals,
            )
    return out


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
) -> list[PlanEndpoint]:
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
            )
            for endpoint, weight, health in rows
        )
    return out


def _route_diagnostics(
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
    affinity: SessionAffinity | None = None,
    **extra: Any,
) -> PlanCluster:
    return PlanCluster(
        name=name,
        protocol=spec.protocol,
        balancing=route.balancing,
        affinity=affinity or route.session_affinity,
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


def _compile_route(
    policy: RoutingPolicy,
    route: Route,
    state: PolicyState,
    weights: Mapping[str, Mapping[str, WeightDecision]],
    admission: AdmissionDecision | None = None,
) -> tuple[list[PlanCluster], PlanRoute]:
    """The clusters of one route and its route entry.

    Replicas (IP endpoints) of every tier go into one EDS cluster at priority = tier. External
    provider pools get a DNS cluster each; when a route has any, an aggregate cluster puts the
    replicas first and the providers after them, in tier order.
    """
    name = cluster_name(policy.metadata.name, route.name)
    route_weights = weights if route.balancing == "telemetry" else {}
    endpoints: list[PlanEndpoint] = []
    providers: list[Pool] = []
    for priority, tier in enumerate(route.tiers):
        endpoints.extend(_tier_endpoints(tier, priority, state, route_weights))
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
    plan_route = PlanRoute(
        name=name,
        cluster=name,
        models=tuple(route.match.models),
        path_prefix=route.match.path_prefix,
        headers=tuple((header.name, header.value) for header in route.match.headers),
        affinity=route.session_affinity,
        retries=route.retries,
        timeouts=route.timeouts,
        rate_limit=route.rate_limit,
        host_rewrite=uses_hostname,
        tiers=len(route.tiers),
        served_models=tuple(
            sorted(
                set(route.match.models)
                or {
                    model
                    for tier in route.tiers
                    for target in tier.pools
                    if (pool := state.pools.get(target.pool)) is not None
                    for model in pool.spec.models
                }
            )
        ),
        classes=_plan_classes(policy, route, admission),
        tenant_header=policy.spec.service_classes.tenant_header
        if policy.spec.service_classes is not None
        else "",
    )
    classes = policy.spec.service_classes
    queues = tuple(
        (queue_cluster_name(name, c.name), c.queue or ClassQueue())
        for c in (classes.queued if classes is not None else [])
    )
    affinity = route.session_affinity
    if affinity is not None and route_weights:
        factor = balance_factor(
            affinity.hash_balance_factor,
            (
                route_weights[pool.metadata.name]
                for pool in local
                if pool.metadata.name in route_weights
            ),
            now=state.now,
        )
        affinity = affinity.model_copy(update={"hash_balance_factor": factor})
    if not providers:
        return [_cluster(name, route, spec, endpoints, affinity, queues=queues)], plan_route
    members: list[str] = []
    clusters: list[PlanCluster] = []
    if local:
        local_name = name + LOCAL_SUFFIX
        clusters.append(
            _cluster(local_name, route, spec, endpoints, affinity, eds_service=name, queues=queues)
        )
        members.append(local_name)
    for pool in providers:
        provider = _provider_cluster(f"{name}/provider/{pool.metadata.name}", route, pool, state)
        clusters.append(provider)
        members.append(provider.name)
    aggregate = _cluster(name, route, spec, (), kind="aggregate", members=tuple(members))
    return [aggregate, *clusters], plan_route


def rollout_clusters(state: PolicyState) -> set[str]:
    """Clusters of the routes that a Rollout analyses with data-plane metrics."""
    return {
        cluster_name(rollout.spec.target.policy, rollout.spec.target.route)
        for rollout in state.rollouts.values()
        if any(rule.metric is not None for rule in rollout.spec.analysis.rules)
    }


def fleet_names(state: PolicyState) -> list[str]:
    """Every fleet that gets its own config: named by a policy or a Fleet object, plus default."""
    names = {DEFAULT_FLEET, *state.fleets}
    for policy in state.policies.values():
        names.update(fleet for fleet in policy.spec.fleets if fleet != "*")
    return sorted(names)


def _applies(policy: RoutingPolicy, fleet: str) -> bool:
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


def compile_plan(state: PolicyState, memo: RouteMemo | None = None) -> RoutingPlan:
    """Build the routing plan for every fleet. Pure: the same state gives the same plan, with
    or without `memo` (which only saves recompiling routes whose inputs did not change)."""
    diagnostics: list[Diagnostic] = []
    compiled: dict[str, tuple[list[PlanCluster], PlanVirtualHost]] = {}
    weights = telemetry_weights(state)
    memo = memo if memo is not None else RouteMemo()
    entries: dict[str, _MemoEntry] = {}
    admission = admission_decisions(state)
    for policy_name in sorted(state.policies):
        policy = state.policies[policy_name]
        policy_clusters = []
        routes = []
        for index, route in enumerate(policy.spec.routes):
            entry = memo.route(
                policy,
                index,
                route,
                state,
                weights,
                admission.get(cluster_name(policy_name, route.name)),
            )
            entries[cluster_name(policy_name, route.name)] = entry
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
            ),
        )

    watched = rollout_clusters(state)
    fleets = []
    for fleet in fleet_names(state):
        in_fleet = _fleet_compiled(state, fleet, compiled, weights, admission)
        fleet_object = state.fleets.get(fleet)
        settings = fleet_object.spec if fleet_object is not None else FleetSpec()
        by_port: dict[int, list[RoutingPolicy]] = {}
        for policy_name in sorted(state.policies):
            policy = state.policies[policy_name]
            if _applies(policy, fleet):
                by_port.setdefault(policy.spec.listener.port, []).append(policy)
        listeners = []
        clusters: list[PlanCluster] = []
        for port in sorted(by_port):
            vhosts, port_clusters, port_diagnostics = _merge_listener(
                fleet, by_port[port], in_fleet
            )
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
                    upstream_signals=any(
                        route.cluster in watched for vhost in vhosts for route in vhost.routes
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
    )


def _fleet_compiled(
    state: PolicyState,
    fleet: str,
    compiled: Mapping[str, tuple[list[PlanCluster], PlanVirtualHost]],
    weights: Mapping[str, Mapping[str, WeightDecision]],
    admission: Mapping[str, AdmissionDecision],
) -> Mapping[str, tuple[list[PlanCluster], PlanVirtualHost]]:
    """``compiled``, with the policies whose tiers weigh pools differently in ``fleet``
    compiled again as that fleet gets them (a rollout's canary fleet; rare and short-lived,
    so not memoised)."""
    out = dict(compiled)
    for name, policy in state.policies.items():
        if fleet not in fleet_weighted(policy) or not _applies(policy, fleet):
            continue
        variant = policy_in(policy, fleet)
        clusters: list[PlanCluster] = []
        routes = []
        for route in variant.spec.routes:
            route_clusters, plan_route = _compile_route(
                variant, route, state, weights, admission.get(cluster_name(name, route.name))
            )
            clusters.extend(route_clusters)
            routes.append(plan_route)
        out[name] = (clusters, replace(compiled[name][1], routes=tuple(routes)))
    return out


@dataclass(frozen=True, slots=True)
class _MemoEntry:
    inputs: tuple[object, ...]
    diagnostics: list[Diagnostic]
    clusters: list[PlanCluster]
    route: PlanRoute


class RouteMemo:
    """What `compile_plan` built for each route last time, and the objects it read to build it.

    A route is compiled again only when it changed, or when one of its other inputs is not the
    very object it was last time: for each pool it names the pool, its registered endpoints and its
    telemetry weights. Callers that keep unchanged objects (the reconciler's decoded state
    replaces a pool's endpoint mapping only when one of them changes) pay for what changed, not
    for the fleet; an endpoint change recompiles the routes of its pool alone, and the plan's
    other clusters stay the same objects, which translation compares by identity first. Inputs
    are held, so an identity is never that of a collected object.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _MemoEntry] = {}

    def route(
        self,
        policy: RoutingPolicy,
        index: int,
        route: Route,
        state: PolicyState,
        weights: Mapping[str, Mapping[str, WeightDecision]],
        admission: AdmissionDecision | None = None,
    ) -> _MemoEntry:
        """The compiled route, reused when its inputs are unchanged."""
        route_weights = weights if route.balancing == "telemetry" else {}
        names = [target.pool for tier in route.tiers for target in tier.pools]
        inputs = (
            (route, policy.spec.service_classes, admission),
            index,
            *(state.pools.get(name) for name in names),
            *(state.registered.get(name) for name in names),
            *(route_weights.get(name) for name in names),
        )
        name = cluster_name(policy.metadata.name, route.name)
        entry = self._entries.get(name)
        if (
            entry is not None
            and len(entry.inputs) == len(inputs)
            # The route, its policy's service classes and its admission are small, and
            # a policy edit makes them all new objects: compare them by value; the rest is large
            # and compared by identity.
            and entry.inputs[0] == inputs[0]
            and all(a is b for a, b in zip(entry.inputs[1:], inputs[1:], strict=True))
        ):
            return entry
        clusters, plan_route = _compile_route(policy, route, state, weights, admission)
        return _MemoEntry(
            inputs, _route_diagnostics(policy, index, route, state), clusters, plan_route
        )

    def keep(self, entries: dict[str, _MemoEntry]) -> None:
        """Remember exactly this compile's routes (dropping the ones that are gone)."""
        self._entries = entries


def _merge_listener(
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


def _dedupe(diagnostics: Iterable[Diagnostic]) -> tuple[Diagnostic, ...]:
    return tuple(dict.fromkeys(diagnostics))
