"""The names compilation gives Envoy resources: a route's cluster, a class's queue cluster, a
port's listener. Translation and the daemon find clusters by these names."""

from __future__ import annotations

LOCAL_SUFFIX = "/local"
"""Suffix of the replicas' cluster of a route whose aggregate cluster also has providers."""
OVERFLOW_INFIX = "/overflow/"
"""Between a route's cluster name and a paid pool's: the aggregate that starts from that pool."""
PROVIDER_INFIX = "/provider/"
"""Between a route's cluster name and an external pool's: that pool's cluster."""
GATE_SUFFIX = "/gate"
"""Suffix of a route's gate (``overflow.maxInFlight``): the internal listener, and the cluster
to it, through which requests reach the owned replicas while they have batch slots free."""
QUEUE_INFIX = "/queue/"
"""Between a route's cluster name and a class name: the cluster that queues that class."""


def cluster_name(policy: str, route: str) -> str:
    """The Envoy cluster of one route."""
    return f"{policy}/{route}"


def queue_cluster_name(route_cluster: str, service_class: str) -> str:
    """The cluster whose circuit breakers queue one class of one route."""
    return f"{route_cluster}{QUEUE_INFIX}{service_class}"


def listener_name(port: int) -> str:
    """The Envoy listener (and route configuration) for one port."""
    return f"listener-{port}"


def provider_cluster_name(route_cluster: str, pool: str) -> str:
    """The cluster of one external provider pool of one route."""
    return f"{route_cluster}{PROVIDER_INFIX}{pool}"


def overflow_cluster_name(route_cluster: str, pool: str) -> str:
    """The aggregate a route's overflow takes while paid pool `pool` is its first choice."""
    return f"{route_cluster}{OVERFLOW_INFIX}{pool}"


def gate_name(route_cluster: str) -> str:
    """The gate of a route's owned replicas: its internal listener and the cluster to it; with
    a cluster name after it, the aggregate that starts from the gate and goes on to that
    cluster's members (``gated_name``)."""
    return f"{route_cluster}{GATE_SUFFIX}"


def gated_name(cluster: str) -> str:
    """The aggregate that tries the gate first, then `cluster` (a paid overflow aggregate's
    members, or a consistent-hash twin of the replicas)."""
    return f"{cluster}{GATE_SUFFIX}"
