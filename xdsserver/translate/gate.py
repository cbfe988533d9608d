"""The gate in front of a route's owned replicas (``overflow.maxInFlight``): paid capacity
for the very request that finds the batch slots taken, without waiting for the share.

Envoy never retries a request its own circuit breaker turned away (an overflow), so the
breaker sits one hop in: the route's entries reach the replicas through an internal
listener, whose router answers a request over ``maxInFlight`` at once with ``GATE_HEADER``.
The entry's cluster is an aggregate that starts from the gate, and its retry on that header
moves to the aggregate's next priority: the paid pools for a request without a session, the
session's own replica (its consistent-hash twin, where it waits for a slot) for one with.
So the breaker counts every request the replicas take through this Envoy, and only the
excess of the moment goes to paid.

Resources per gated route: the gate's cluster (a copy of the replicas' cluster, the same EDS
resource, with the breaker), the internal listener and the static cluster to it, and the
aggregates that try the gate first (``compiler.routes`` names the paid ones; the session
ones are made here, one per consistent-hash twin).
"""

from __future__ import annotations

from dataclasses import replace

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from google.protobuf import wrappers_pb2

from compiler.plan import PlanCluster
from policies.names import GATE_SUFFIX, gated_name
from xdsserver.translate.clusters import (
    affinity_suffixes,
    aggregate_cluster,
    hash_twin,
    translate_cluster,
)
from xdsserver.translate.listeners import local_replies
from xdsserver.translate.metadata import GATE_UPSTREAM, PREFIX_KEY_HEADER
from xdsserver.translate.protos import duration, http_filter_chain, pack

GATE_HEADER = "x-kvpilot-gate-full"
"""Set by the gate on the answer to a request it turned away (Envoy's ``UO`` flag: the
circuit breaker's overflow); the route's retry policy retries on it. It never reaches a
client unless the retries ran out."""
REPLICAS_SUFFIX = "/replicas"
"""After the gate's name: the cluster behind the gate, with the breaker."""
GATE_RETRIES = 1024
"""Retries in flight the gated aggregates allow (Envoy's default of 3 would turn away the
spill of a peak: each spilled request is a retry)."""


def gate_clusters(gate: PlanCluster, *, trusted_ca_file: str) -> list[cluster_pb2.Cluster]:
    """The cluster behind the gate (breaker at ``circuit_breakers.max_requests``), the static
    cluster to the gate's internal listener, and per consistent-hash twin of the replicas the
    aggregate that tries the gate first, then that twin."""
    behind = _behind(gate, trusted_ca_file)
    owned = gate.name.removesuffix(GATE_SUFFIX)
    out = [behind, _to_listener(gate)]
    for suffix in affinity_suffixes(gate):
        out.append(gated_aggregate(gated_name(owned + suffix), (gate.name, owned + suffix), gate))
    return out


def gated_aggregate(
    name: str, members: tuple[str, ...], cluster: PlanCluster
) -> cluster_pb2.Cluster:
    """An aggregate that starts from the gate; its retries in flight are not bounded by
    Envoy's default of 3."""
    out = aggregate_cluster(name, members, cluster.connect_timeout)
    thresholds = out.circuit_breakers.thresholds.add()
    thresholds.max_retries.value = GATE_RETRIES
    return out


def _behind(gate: PlanCluster, trusted_ca_file: str) -> cluster_pb2.Cluster:
    """The replicas' cluster as the gate's route reaches it: with session affinity their
    consistent-hash twin bounded at the mean of what the gate lets in (both kinds of request
    pass the gate: the breaker counts them all), else their own balancing."""
    name = gate.name + REPLICAS_SUFFIX
    replicas = replace(gate, kind="eds", name=name)
    if gate.affinity is not None:
        # No replica above the mean of what the gate lets in: at the limit, no replica holds
        # more than its batch.
        return hash_twin(replicas, name, 100, trusted_ca_file)
    # Least request scans every replica (``translate_cluster``): at a limit of the batch
    # slots, a request waits at home only when every slot is taken.
    return translate_cluster(replicas, trusted_ca_file=trusted_ca_file)[0]


def _to_listener(gate: PlanCluster) -> cluster_pb2.Cluster:
    endpoint = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(
                envoy_internal_address=address_pb2.EnvoyInternalAddress(
                    server_listener_name=gate.name
                )
            )
        )
    )
    return cluster_pb2.Cluster(
        name=gate.name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration(gate.connect_timeout),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=gate.name,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint])],
        ),
    )


def gate_listener(gate: PlanCluster) -> listener_pb2.Listener:
    """The gate's internal listener: one route to the cluster behind it (hashing on the
    session header as the route's affinity entry does), whose router marks the requests the
    breaker turns away with ``GATE_HEADER`` instead of Envoy's ``x-envoy-overloaded`` (which
    no retry policy may retry on)."""
    action = route_components_pb2.RouteAction(
        cluster=gate.name + REPLICAS_SUFFIX,
        # The outer route owns timeouts and retries.
        timeout=duration(0),
    )
    # A pool's hostRewrite (the endpoint's hostname); endpoints without one keep the Host.
    action.auto_host_rewrite.value = True
    if gate.affinity is not None:
        # A request carries one of the two at most (the prompt-prefix key is derived only
        # without a session header), so each hashes as the route's entry for it does.
        headers = [gate.affinity.header]
        if gate.affinity.prefix_hash_chars:
            headers.append(PREFIX_KEY_HEADER)
        action.hash_policy.extend(
            route_components_pb2.RouteAction.HashPolicy(
                header=route_components_pb2.RouteAction.HashPolicy.Header(header_name=header)
            )
            for header in headers
        )
    replies = local_replies(rate_limited=False)
    # The first mapper that matches applies: the refusal keeps the 5xx body in OpenAI's
    # format (what a client sees should the retries run out) and gets the header.
    full = hcm_pb2.ResponseMapper()
    full.CopyFrom(replies.mappers[-1])
    full.filter.CopyFrom(
        accesslog_pb2.AccessLogFilter(
            response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=["UO"])
        )
    )
    full.headers_to_add.append(
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=GATE_HEADER, value="1"))
    )
    replies.mappers.insert(0, full)
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=gate.name.replace("/", "_"),
        route_config=route_pb2.RouteConfiguration(
            name=gate.name,
            virtual_hosts=[
                route_components_pb2.VirtualHost(
                    name="gate",
                    domains=["*"],
                    routes=[
                        route_components_pb2.Route(
                            match=route_components_pb2.RouteMatch(prefix="/"),
                            route=action,
                            response_headers_to_add=[
                                base_pb2.HeaderValueOption(
                                    header=base_pb2.HeaderValue(
                                        key=GATE_UPSTREAM, value="%UPSTREAM_REMOTE_ADDRESS%"
                                    ),
                                    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                                )
                            ],
                        )
                    ],
                )
            ],
        ),
        http_filters=[
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.router",
                typed_config=pack(router_pb2.Router(suppress_envoy_headers=True)),
            )
        ],
        stream_idle_timeout=duration(0),
        local_reply_config=replies,
    )
    listener = listener_pb2.Listener(name=gate.name, filter_chains=[http_filter_chain(manager)])
    listener.internal_listener.SetInParent()
    return listener


SESSION_TRIES = 12
"""Tries a conversation's turn makes at the gate before it waits on its replica: each retry
after the route's back-off (25 ms doubling to 250 ms by default, drawn at random), about 1.5 s
in all. Meanwhile it waits in Envoy, not in the replica's queue, so the gate's count stays
what the replicas hold."""


def gate_retries(entry: route_components_pb2.Route, *, tries: int = 1) -> None:
    """Make `entry` (whose cluster is a gated aggregate) retry a request the gate turned
    away, on top of its own retries: on the aggregate's next priority once the gate has
    turned it away `tries` times."""
    policy = entry.route.retry_policy
    conditions = [c for c in policy.retry_on.split(",") if c]
    policy.retry_on = ",".join(dict.fromkeys([*conditions, "retriable-headers"]))
    policy.retriable_headers.append(
        route_components_pb2.HeaderMatcher(name=GATE_HEADER, present_match=True)
    )
    policy.num_retries.CopyFrom(wrappers_pb2.UInt32Value(value=policy.num_retries.value + tries))
    # previous_priorities leaves a priority once it has taken `update_frequency` tries.
    policy.retry_priority.CopyFrom(
        route_components_pb2.RetryPolicy.RetryPriority(
            name="envoy.retry_priorities.previous_priorities",
            typed_config=pack(
                previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=tries)
            ),
        )
    )
