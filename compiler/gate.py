"""The gate of a route's owned replicas (``overflow.maxInFlight``): the plan's side of it.

A ``gate`` cluster is a copy of the replicas' cluster whose breaker allows ``maxInFlight``
requests, which translation puts behind an internal listener (``xdsserver.translate.gate``);
each paid overflow aggregate gets a twin that tries the gate first."""

from __future__ import annotations

from dataclasses import replace

from compiler.plan import PlanCluster
from policies.models import Route
from policies.names import OVERFLOW_INFIX, gate_name, gated_name


def gate_clusters(
    name: str,
    route: Route,
    clusters: list[PlanCluster],
    replicas: str,
    subsets: bool,
) -> list[PlanCluster]:
    """With ``overflow.maxInFlight``: the gate in front of the route's replicas (a copy of
    their cluster whose circuit breaker allows that many requests, behind an internal
    listener), and for each paid overflow aggregate the one that tries the gate first.
    None without a limit, with providers among the route's tiers, or where the replicas are
    chosen by model subsets (the request's model, in its own metadata, does not pass an
    internal listener).
    """
    assert route.overflow is not None
    limit = route.overflow.max_in_flight
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
