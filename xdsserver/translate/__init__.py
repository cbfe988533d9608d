"""Routing plan -> Envoy resources (CDS, EDS, LDS, RDS). Pure: no I/O, no state.

Each function maps one plan type to one Envoy proto, so a reader can hold a plan dataclass and
its Envoy counterpart side by side: ``clusters`` (CDS, EDS), ``providers`` (external providers),
``listeners`` (LDS) and ``routes`` (RDS), which builds on ``entries`` (one route entry),
``classes`` (service classes' entries and stats) and ``ratelimits`` (local rate limits).
Envoy behaviours that shaped a choice are cited inline; the measured ones are in the design
notes.
"""

from __future__ import annotations

from dataclasses import dataclass

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf.message import Message

from compiler.plan import FleetPlan, PlanCluster
from policies.names import GATE_SUFFIX
from xdsserver import resources
from xdsserver.translate.clusters import (
    AFFINITY_SUFFIX,
    SATURATED_SUFFIX,
    UNBOUNDED_SUFFIX,
    aggregate_clusters,
    listener_members,
    translate_cluster,
    translate_endpoints,
)
from xdsserver.translate.difficulty import scorer_clusters
from xdsserver.translate.escalation import escalation_clusters
from xdsserver.translate.gate import gate_clusters, gate_listener, gated_aggregate
from xdsserver.translate.listeners import translate_listener
from xdsserver.translate.metadata import PREFIX_KEY_HEADER
from xdsserver.translate.providers import credential_listener, internal_cluster, provider_cluster
from xdsserver.translate.routes import prefix_key_lua, translate_route_configuration
from xdsserver.translate.tracing import COLLECTOR_CLUSTER, collector_cluster


@dataclass(frozen=True, slots=True)
class FleetResources:
    """The four resource lists that make up one fleet's configuration."""

    clusters: tuple[cluster_pb2.Cluster, ...]
    endpoints: tuple[endpoint_pb2.ClusterLoadAssignment, ...]
    listeners: tuple[listener_pb2.Listener, ...]
    routes: tuple[route_pb2.RouteConfiguration, ...]

    def by_type(self) -> dict[str, tuple[Message, ...]]:
        """Resources keyed by xDS type URL, in make-before-break order."""
        return {
            resources.CLUSTER: self.clusters,
            resources.ENDPOINT: self.endpoints,
            resources.LISTENER: self.listeners,
            resources.ROUTE: self.routes,
        }


def translate(plan: FleetPlan) -> FleetResources:
    """All Envoy resources for one fleet."""
    clusters: list[cluster_pb2.Cluster] = []
    endpoints: list[endpoint_pb2.ClusterLoadAssignment] = []
    behind_listener = frozenset(cluster.name for cluster in _authenticated_providers(plan))
    for cluster in plan.clusters:
        if cluster.kind == "eds":
            clusters.extend(translate_cluster(cluster, trusted_ca_file=plan.trusted_ca_file))
            endpoints.append(translate_endpoints(cluster))
        elif cluster.kind == "aggregate" and cluster.name.endswith(GATE_SUFFIX):
            members = listener_members(cluster.members, behind_listener)
            clusters.append(gated_aggregate(cluster.name, members, cluster))
        elif cluster.kind == "aggregate":
            clusters.extend(aggregate_clusters(cluster, behind_listener))
        elif cluster.kind == "gate":
            clusters.extend(gate_clusters(cluster, trusted_ca_file=plan.trusted_ca_file))
        else:
            clusters.append(provider_cluster(cluster, plan.trusted_ca_file))
            if cluster.auth is not None:
                clusters.append(internal_cluster(cluster))
    vhosts = [vhost for listener in plan.listeners for vhost in listener.virtual_hosts]
    clusters.extend(scorer_clusters(vhosts))
    clusters.extend(escalation_clusters(vhosts))
    if plan.tracing is not None:
        clusters.append(collector_cluster(plan.tracing))
    return FleetResources(
        clusters=tuple(clusters),
        endpoints=tuple(endpoints),
        listeners=translate_listeners(plan),
        routes=translate_routes(plan),
    )


def translate_listeners(plan: FleetPlan) -> tuple[listener_pb2.Listener, ...]:
    """LDS alone: the policies' listeners, then an internal listener per provider with a
    credential header (it depends on the clusters and the fleet's secrets directory only)."""
    return (
        *(translate_listener(listener) for listener in plan.listeners),
        *(
            credential_listener(cluster, plan.secrets_dir)
            for cluster in _authenticated_providers(plan)
        ),
        *(gate_listener(cluster) for cluster in plan.clusters if cluster.kind == "gate"),
    )


def translate_routes(plan: FleetPlan) -> tuple[route_pb2.RouteConfiguration, ...]:
    """RDS alone: one route configuration per listener."""
    return tuple(translate_route_configuration(listener) for listener in plan.listeners)


def _authenticated_providers(plan: FleetPlan) -> list[PlanCluster]:
    return [cluster for cluster in plan.clusters if cluster.kind == "dns" and cluster.auth]


__all__ = [
    "AFFINITY_SUFFIX",
    "COLLECTOR_CLUSTER",
    "PREFIX_KEY_HEADER",
    "SATURATED_SUFFIX",
    "UNBOUNDED_SUFFIX",
    "FleetResources",
    "prefix_key_lua",
    "translate",
    "translate_cluster",
    "translate_endpoints",
    "translate_listener",
    "translate_listeners",
    "translate_route_configuration",
    "translate_routes",
]
