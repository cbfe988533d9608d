"""The gate of a route's owned replicas (``overflow.maxInFlight``): the plan's side of it,
and the limit ``auto`` sets from the batch slots and the Envoys connected.

A ``gate`` cluster is a copy of the replicas' cluster whose breaker allows ``maxInFlight``
requests, which translation puts behind an internal listener (``xdsserver.translate.gate``);
each paid overflow aggregate gets a twin that tries the gate first."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace

from compiler.locality import SERVING, batch_slots
from compiler.plan import DEFAULT_FLEET, PlanCluster
from policies.models import Route, RoutingPolicy
from policies.names import OVERFLOW_INFIX, gate_name, gated_name
from signals.state import PolicyState, is_external, pool_endpoints

GATE_OPEN = 100_000
"""``maxInFlight: auto`` while no serving replica of the first tier reports a batch size (at
start, or every one gone or drained): the field's largest limit, a gate that turns nothing
away for being full. The gate stays: its resources do not come and go with telemetry, and a
request that finds no healthy replica behind it still goes on to the paid pools (the gate's
503 is retried there, as at any limit)."""


def gate_limit(route: Route, basis: tuple[int, int] | None) -> int | None:
    """The gate's limit per Envoy: ``overflow.maxInFlight``, or with ``auto`` the share
    ``Overflow.auto_share`` of the batch slots that the first tier's replicas report over
    the Envoys connected in the policy's fleets (`basis`, ``auto_basis``'s), at least 1, or
    ``GATE_OPEN`` while none reports one. None without a gate."""
    if route.overflow is None or route.overflow.max_in_flight is None:
        return None
    if route.overflow.max_in_flight != "auto":
        return route.overflow.max_in_flight
    slots, envoys = basis or (0, 0)
    if not slots:
        return GATE_OPEN
    return max(1, math.floor(route.overflow.auto_share() * slots / max(1, envoys)))


def auto_basis(
    policy: RoutingPolicy, route: Route, state: PolicyState, fleets: Collection[str]
) -> tuple[int, int] | None:
    """What ``maxInFlight: auto`` splits, None on a route without it: the batch slots of the
    route's first tier (its replicas that serve, healthy or degraded, with a fresh batch
    size: a draining one takes no new request) and the Envoys connected in the policy's
    fleets (none: the limit is as for one). An Envoy of a fleet not among `fleets` (those
    with a config of their own, ``compiler.fleets.fleet_names``) is served the default
    fleet's, and counts there."""
    if route.overflow is None or route.overflow.max_in_flight != "auto":
        return None
    sized = batch_slots(state)
    slots = 0
    for target in route.tiers[0].pools if route.tiers else ():
        pool = state.pools.get(target.pool)
        if pool is None or is_external(pool):
            continue
        for endpoint in pool_endpoints(pool, state.registered.get(target.pool, {})):
            if endpoint.health in SERVING:
                slots += sized.get(endpoint.key, 0)
    named = policy.spec.fleets
    envoys = 0
    for fleet, count in state.envoys.items():
        served = fleet if fleet in fleets else DEFAULT_FLEET
        if "*" in named or served in named:
            envoys += count
    return slots, envoys


def gate_clusters(
    name: str,
    route: Route,
    clusters: list[PlanCluster],
    replicas: str,
    subsets: bool,
    limit: int | None,
) -> list[PlanCluster]:
    """With ``overflow.maxInFlight``: the gate in front of the route's replicas (a copy of
    their cluster whose circuit breaker allows that many requests, behind an internal
    listener), and for each paid overflow aggregate the one that tries the gate first, at
    `limit` (``gate_limit``). None without a limit, with providers among the route's tiers,
    or where the replicas are chosen by model subsets (the request's model, in its own
    metadata, does not pass an internal listener).
    """
    owned = next((c for c in clusters if c.name == replicas and c.kind == "eds"), None)
    if not limit or owned is None or subsets or replicas != name:
        # Behind a route's aggregate (providers among its tiers) the session's twin would be
        # an aggregate itself, which an aggregate cannot hold.
        return []
    gate = replace(
        owned,
        name=gate_name(name),
        kind="gate",
        eds_service=owned.eds_service or owned.name,
        circuit_breakers=owned.circuit_breakers.model_copy(update={"max_requests": limit}),
        queues=(),
    )
    out = [gate]
    for cluster in clusters:
        if cluster.kind == "aggregate" and OVERFLOW_INFIX in cluster.name:
            out.append(
                replace(
                    cluster,
                    name=gated_name(cluster.name),
                    members=(gate.name, *cluster.members),
                    affinity=None,
                )
            )
    return out
