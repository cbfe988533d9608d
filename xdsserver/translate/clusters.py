"""CDS and EDS for the route clusters: replicas by priority, the consistent-hash twin, the
aggregate that adds external providers, and the ClusterLoadAssignments."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import (
    base_pb2,
    health_check_pb2,
    protocol_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import wrappers_pb2

from compiler.plan import PlanCluster, PlanEndpoint
from policies.models import UNBOUNDED_RUNG, SessionAffinity
from policies.names import LOCAL_SUFFIX
from xdsserver.translate.balancers import (
    full_scan_policy,
    model_subsets_policy,
    orca_policy,
)
from xdsserver.translate.metadata import MODEL_METADATA_KEY, MODEL_METADATA_NAMESPACE
from xdsserver.translate.protos import (
    HTTP_PROTOCOL_OPTIONS,
    ads_source,
    duration,
    pack,
)

AFFINITY_SUFFIX = "/affinity"
"""Suffix of the consistent-hash twin of a route cluster (same endpoints, same EDS resource)."""
SATURATED_SUFFIX = "/affinity-saturated"
"""Suffix of the consistent-hash twin that bounds load tighter, for session requests while
the route's replicas are saturated (``SessionAffinity.saturated_hash_balance_factor``)."""
UNBOUNDED_SUFFIX = "/affinity-unbounded"
"""Suffix of a ``capacityBound`` route's twin without a bound (``UNBOUNDED_RUNG``), for
session requests while all the pool's requests in flight fit one replica's usable batch."""
INTERNAL_SUFFIX = "/internal"
"""Suffix of the internal listener (and its cluster) in front of an authenticated provider."""

_HEALTH = {
    "healthy": health_check_pb2.HEALTHY,
    "unhealthy": health_check_pb2.UNHEALTHY,
    "draining": health_check_pb2.DRAINING,
    "degraded": health_check_pb2.DEGRADED,
}
_LB_POLICY = {
    "round_robin": cluster_pb2.Cluster.ROUND_ROBIN,
    "least_request": cluster_pb2.Cluster.LEAST_REQUEST,
    "random": cluster_pb2.Cluster.RANDOM,
    # Telemetry weights are endpoint weights, which least request follows while also
    # counting in-flight requests (design.md).
    "telemetry": cluster_pb2.Cluster.LEAST_REQUEST,
    "orca": cluster_pb2.Cluster.LEAST_REQUEST,
}


def translate_cluster(cluster: PlanCluster, *, trusted_ca_file: str) -> list[cluster_pb2.Cluster]:
    """The route's replicas cluster, plus a consistent-hash twin when the route has session
    affinity (two when its bounded load tightens under saturation).

    All read the same ClusterLoadAssignment (``eds_cluster_config.service_name``), so a
    weight change is one EDS update. Requests with the session header go to a twin;
    requests without it keep the route's balancing mode instead of landing on a random host.
    """
    base = cluster_base(cluster, cluster.name, trusted_ca_file)
    base.lb_policy = _LB_POLICY[cluster.balancing]
    # Pools that share a tier (a 90/10 rollout) are localities of their own, weighted by the
    # pool's share: Envoy picks the locality by weight first (a deterministic weighted
    # schedule, exact per request), then a host inside it by the cluster's policy. Endpoint
    # weights alone drift under least request, which divides each host's weight by its
    # requests in flight: concurrent clients pushed a 10% canary to 22%.
    if cluster.balancing == "orca":
        # load_balancing_policy takes precedence over lb_policy. Envoy refuses it beside
        # locality-weighted balancing, and client-side weighted round robin has no locality
        # option: its split follows endpoint weights scaled by the load the hosts report.
        base.load_balancing_policy.CopyFrom(orca_policy())
    elif cluster.balancing == "least_request" and cluster.model_subsets:
        # The model subsets as Envoy's subset policy over the full scan: a policy extension
        # and lb_subset_config do not combine.
        base.ClearField("lb_subset_config")
        base.load_balancing_policy.CopyFrom(model_subsets_policy(full_scan_policy()))
    elif cluster.balancing == "least_request":
        base.load_balancing_policy.CopyFrom(full_scan_policy())
    else:
        base.common_lb_config.locality_weighted_lb_config.SetInParent()
        if cluster.model_subsets:
            # Pools sharing a tier (a split) keep their locality weights within a subset.
            # Envoy refuses this without locality-weighted balancing (the hash twins).
            base.lb_subset_config.locality_weight_aware = True
    out = [base]
    affinity = cluster.affinity
    if affinity is not None:
        # The saturated twin has the same endpoints, weights and hash keys, so the same
        # ring: a session keeps its replica whichever twin its request takes. Each twin
        # counts its own requests in flight.
        out.extend(
            hash_twin(cluster, cluster.name + suffix, factor, trusted_ca_file)
            for suffix, factor in affinity_twins(cluster)
        )
    for name, queue in cluster.queues:
        # A queued service class: with http1 each request in flight holds a connection of
        # its own, so a connection limit is a concurrency limit, and a request that finds
        # none free waits in Envoy's connection pool, up to max_pending_requests; past that
        # Envoy answers 503 at once. (max_requests would refuse instead of queueing.)
        held = cluster_pb2.Cluster()
        held.CopyFrom(base)
        held.name = name
        thresholds = held.circuit_breakers.thresholds[0]
        thresholds.max_connections.value = queue.concurrency
        thresholds.max_pending_requests.value = queue.size
        out.append(held)
    return out


def hash_twin(
    cluster: PlanCluster, name: str, factor: int, trusted_ca_file: str
) -> cluster_pb2.Cluster:
    """The replicas' consistent-hash cluster `name` (ring hash or maglev, as the route's
    session affinity says), bounded at `factor`% of the mean load (0: no bound)."""
    assert cluster.affinity is not None
    twin = cluster_base(cluster, name, trusted_ca_file)
    if cluster.affinity.algorithm == "maglev":
        twin.lb_policy = cluster_pb2.Cluster.MAGLEV
    else:
        twin.lb_policy = cluster_pb2.Cluster.RING_HASH
        twin.ring_hash_lb_config.minimum_ring_size.value = 1024
    if factor:
        # Bounded load: no host above factor% of the average in-flight load.
        twin.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value = factor
    return twin


def aggregate_clusters(
    cluster: PlanCluster, behind_listener: frozenset[str] = frozenset()
) -> list[cluster_pb2.Cluster]:
    """Failover from the route's replicas to external providers, in order.

    Envoy's aggregate cluster lays the members' priorities end to end, so health-based
    failover and retries with previous_priorities work across them. With session affinity a
    twin aggregate starts from the replicas' consistent-hash cluster instead.
    """
    members = listener_members(cluster.members, behind_listener)
    variants = [(cluster.name, members)]
    suffixes = affinity_suffixes(cluster)
    for suffix in suffixes:
        variants.append(
            (
                cluster.name + suffix,
                tuple(
                    member + suffix if member == cluster.name + LOCAL_SUFFIX else member
                    for member in members
                ),
            )
        )
    return [aggregate_cluster(name, members, cluster.connect_timeout) for name, members in variants]


def listener_members(members: Iterable[str], behind_listener: frozenset[str]) -> tuple[str, ...]:
    """An aggregate's `members`, each provider whose auth header an internal listener adds
    (`behind_listener`) named by the cluster that reaches that listener."""
    return tuple(
        member + INTERNAL_SUFFIX if member in behind_listener else member for member in members
    )


def aggregate_cluster(
    name: str, members: Iterable[str], connect_timeout: float
) -> cluster_pb2.Cluster:
    """Envoy's aggregate cluster over `members`, highest priority first."""
    aggregate = cluster_pb2.Cluster(
        name=name,
        connect_timeout=duration(connect_timeout),
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
    )
    aggregate.cluster_type.name = "envoy.clusters.aggregate"
    aggregate.cluster_type.typed_config.CopyFrom(
        pack(aggregate_pb2.ClusterConfig(clusters=list(members)))
    )
    return aggregate


def affinity_suffixes(cluster: PlanCluster) -> tuple[str, ...]:
    """The name suffixes of a cluster's consistent-hash twins (none without affinity)."""
    return tuple(suffix for suffix, _ in affinity_twins(cluster))


def twin_suffix(affinity: SessionAffinity, factor: int) -> str:
    """The name suffix of the consistent-hash twin bounded at `factor` percent: the usual
    bound's ``/affinity``, the saturated bound's ``/affinity-saturated``, a ``capacityBound``
    ladder's rung without a bound (``UNBOUNDED_RUNG``) ``/affinity-unbounded``, any other rung
    ``/affinity-<factor>``."""
    if factor == affinity.hash_balance_factor:
        return AFFINITY_SUFFIX
    if factor == affinity.saturated_hash_balance_factor:
        return SATURATED_SUFFIX
    if factor == UNBOUNDED_RUNG:
        return UNBOUNDED_SUFFIX
    return f"{AFFINITY_SUFFIX}-{factor}"


def affinity_twins(cluster: PlanCluster) -> tuple[tuple[str, int], ...]:
    """(name suffix, bounded load; 0 for none) of each consistent-hash twin of a cluster
    (``twins``); none without affinity."""
    return () if cluster.affinity is None else twins(cluster.affinity)


def twins(affinity: SessionAffinity) -> tuple[tuple[str, int], ...]:
    """(name suffix, bounded load Envoy is sent; 0 for none) of each consistent-hash twin of
    a route with `affinity`: the usual one, the saturated one when the route tightens under
    saturation, one per rung of a ``capacityBound`` route's ladder (``SessionAffinity.ladder``,
    whose ``UNBOUNDED_RUNG`` is a twin without a bound)."""
    factors = [affinity.hash_balance_factor]
    if affinity.saturated_hash_balance_factor:
        factors.append(affinity.saturated_hash_balance_factor)
    factors.extend(rung for rung in affinity.ladder() if rung not in factors)
    return tuple(
        (twin_suffix(affinity, factor), 0 if factor == UNBOUNDED_RUNG else factor)
        for factor in factors
    )


def model_subsets() -> cluster_pb2.Cluster.LbSubsetConfig:
    """Adapter-aware routing: one subset per model an endpoint lists in ``envoy.lb``
    ``model`` (a list: ``list_as_any`` makes each element a subset of its own).

    The request names its subset without a route entry doing anything: the router merges the
    request's ``envoy.lb`` dynamic metadata, where json_to_metadata put the body's ``model``,
    into the route's metadata match. A model no endpoint lists (an adapter loaded nowhere,
    or a request before the first report) falls back to any endpoint, which loads it on
    demand. The subsets use the cluster's own policy: ring hash and bounded load hash within
    the replicas that have the adapter. Selectors and fallback never change with what is
    loaded, so a load or unload is an EDS update only (the endpoints' metadata)."""
    return cluster_pb2.Cluster.LbSubsetConfig(
        fallback_policy=cluster_pb2.Cluster.LbSubsetConfig.ANY_ENDPOINT,
        subset_selectors=[
            cluster_pb2.Cluster.LbSubsetConfig.LbSubsetSelector(keys=[MODEL_METADATA_KEY])
        ],
        list_as_any=True,
    )


def cluster_base(cluster: PlanCluster, name: str, trusted_ca_file: str) -> cluster_pb2.Cluster:
    out = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=ads_source(), service_name=cluster.eds_service or cluster.name
        ),
        connect_timeout=duration(cluster.connect_timeout),
    )
    # Apply a new host set at once; the 1 s default merge window delays failover.
    out.common_lb_config.update_merge_window.CopyFrom(duration(0))
    if cluster.model_subsets:
        out.lb_subset_config.CopyFrom(model_subsets())
    # With active health checks Envoy keeps an endpoint that EDS removed for as long as it
    # passes its checks; a removal through kvpilot must take it out of rotation now.
    out.ignore_health_on_host_removal = True
    protocol_options = http_protocol_options_pb2.HttpProtocolOptions()
    if cluster.protocol == "http2":
        protocol_options.explicit_http_config.http2_protocol_options.CopyFrom(
            protocol_pb2.Http2ProtocolOptions()
        )
    else:
        protocol_options.explicit_http_config.http_protocol_options.CopyFrom(
            protocol_pb2.Http1ProtocolOptions()
        )
    out.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(pack(protocol_options))

    check = cluster.health_check
    if check.enabled:
        out.health_checks.append(
            health_check_pb2.HealthCheck(
                timeout=duration(check.timeout),
                interval=duration(check.interval),
                # Idle tiers are checked as often as busy ones: failover needs to know
                # whether priority 1 is healthy before traffic reaches it.
                no_traffic_interval=duration(check.interval),
                unhealthy_threshold=wrappers_pb2.UInt32Value(value=check.unhealthy_threshold),
                healthy_threshold=wrappers_pb2.UInt32Value(value=check.healthy_threshold),
                http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path=check.path),
            )
        )
    outlier = cluster.outlier_detection
    if outlier.enabled:
        out.outlier_detection.CopyFrom(
            outlier_detection_pb2.OutlierDetection(
                consecutive_5xx=wrappers_pb2.UInt32Value(value=outlier.consecutive_5xx),
                consecutive_gateway_failure=wrappers_pb2.UInt32Value(
                    value=outlier.consecutive_gateway_failure
                ),
                # Envoy's default enforcement for gateway failures is 0%.
                enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=100),
                interval=duration(outlier.interval),
                base_ejection_time=duration(outlier.base_ejection_time),
                # Envoy's default of 10% never ejects anything among fewer than 10 hosts.
                max_ejection_percent=wrappers_pb2.UInt32Value(value=outlier.max_ejection_percent),
                # By default a passing active health check un-ejects the host at once: a
                # replica that answers 5xx to inference while /health says 200 would be back
                # within one health-check interval. It serves again when its ejection ends.
                successful_active_health_check_uneject_host=wrappers_pb2.BoolValue(value=False),
            )
        )
    breakers = cluster.circuit_breakers
    out.circuit_breakers.CopyFrom(
        circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    max_connections=wrappers_pb2.UInt32Value(value=breakers.max_connections),
                    max_pending_requests=wrappers_pb2.UInt32Value(
                        value=breakers.max_pending_requests
                    ),
                    max_requests=wrappers_pb2.UInt32Value(value=breakers.max_requests),
                    max_retries=wrappers_pb2.UInt32Value(value=breakers.max_retries),
                )
            ]
        )
    )
    if cluster.tls is not None:
        sni = cluster.tls.sni or (cluster.endpoints[0].address if cluster.endpoints else "")
        context = tls_pb2.UpstreamTlsContext(sni=sni)
        if not cluster.tls.insecure_skip_verify:
            # Without a validation context Envoy would not verify the server at all; Envoy
            # also refuses SAN matching without a trusted CA file.
            validation = context.common_tls_context.validation_context
            validation.trusted_ca.filename = cluster.tls.ca_file or trusted_ca_file
            if sni:
                validation.match_typed_subject_alt_names.append(
                    common_pb2.SubjectAltNameMatcher(
                        san_type=common_pb2.SubjectAltNameMatcher.DNS,
                        matcher=string_pb2.StringMatcher(exact=sni),
                    )
                )
        out.transport_socket.name = "envoy.transport_sockets.tls"
        out.transport_socket.typed_config.CopyFrom(pack(context))
    return out


def translate_endpoints(cluster: PlanCluster) -> endpoint_pb2.ClusterLoadAssignment:
    """One ClusterLoadAssignment per route: tier k at priority k, grouped by locality.

    Each pool of a tier is a locality of its own (its name as the sub-zone, within the
    endpoints' region and zone), weighted by the sum of its endpoints' weights: what the route
    cluster's locality-weighted balancing splits by (``translate_cluster``). The consistent-hash
    twin does not weigh localities; it follows the same endpoint weights on its ring.

    Each endpoint carries only what Envoy balances by: its address, health and weight (and
    ``envoy.lb`` ``hash_key`` for a named replica). Its pool is already its locality's
    sub-zone; a copy of it in every endpoint's metadata would cost each Envoy about half of
    its CPU time per EDS update (measured at 500 endpoints a cluster), since Envoy compares
    every host's metadata on each update.

    The endpoints of a locality are joined from their serialized form (`_lb_endpoint_entry`,
    cached) and parsed once: a rebuild re-sends mostly unchanged endpoints, and at 500 to a
    locality this is several times faster than building each message again."""
    groups: dict[tuple[int, str, str, str], list[PlanEndpoint]] = {}
    for endpoint in cluster.endpoints:
        key = (endpoint.priority, endpoint.region, endpoint.zone, endpoint.pool)
        groups.setdefault(key, []).append(endpoint)
    out = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster.eds_service or cluster.name)
    if cluster.overprovisioning:
        # A saturated locality keeps this share of its fleet's traffic when fully healthy;
        # Envoy sends the rest to the next priority (signals.spill).
        out.policy.overprovisioning_factor.value = cluster.overprovisioning
    for (priority, region, zone, sub_zone), members in sorted(groups.items()):
        locality = out.endpoints.add(priority=priority)
        locality.locality.CopyFrom(base_pb2.Locality(region=region, zone=zone, sub_zone=sub_zone))
        locality.load_balancing_weight.value = max(1, sum(e.weight for e in members))
        # Serialized fields of one message, concatenated, parse as those fields appended.
        locality.MergeFromString(b"".join([_lb_endpoint_entry(e) for e in members]))
    return out


_LB_ENDPOINTS_TAG = bytes([2 << 3 | 2])
"""``LocalityLbEndpoints.lb_endpoints`` (field 2), length-delimited: the key of each entry."""


@functools.lru_cache(maxsize=1 << 15)
def _lb_endpoint_entry(endpoint: PlanEndpoint) -> bytes:
    """One endpoint as an encoded ``lb_endpoints`` entry: key, length, the LbEndpoint. Cached
    by the plan's endpoint (a frozen value): the same endpoint is the same bytes."""
    lb_endpoint = endpoint_components_pb2.LbEndpoint(health_status=_HEALTH[endpoint.health])
    host = lb_endpoint.endpoint
    address = host.address.socket_address
    address.address = endpoint.address
    address.port_value = endpoint.port
    if endpoint.hostname:
        host.hostname = endpoint.hostname
    weight = lb_endpoint.load_balancing_weight
    if endpoint.weight:
        weight.value = endpoint.weight
    else:
        weight.SetInParent()  # present even at 0, as the weight was always sent
    if endpoint.hash_key:
        # Ring hash and Maglev place a host by ``envoy.lb`` ``hash_key`` when it has one, else
        # by its address: a named replica keeps its place on the ring (its sessions, its KV
        # cache) across a new address or port.
        lb_endpoint.metadata.filter_metadata["envoy.lb"].fields[
            "hash_key"
        ].string_value = endpoint.hash_key
    if endpoint.models:
        # The subsets of a cluster that routes by model (`model_subsets`).
        lb_endpoint.metadata.filter_metadata[MODEL_METADATA_NAMESPACE].fields[
            MODEL_METADATA_KEY
        ].list_value.extend(endpoint.models)
    body: bytes = lb_endpoint.SerializeToString(deterministic=True)
    return _LB_ENDPOINTS_TAG + _varint(len(body)) + body


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint encoding of a non-negative integer."""
    if value < 0x80:
        return bytes((value,))  # most endpoints' encodings are shorter than 128 bytes
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
