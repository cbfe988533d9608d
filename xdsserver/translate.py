"""Routing plan -> Envoy resources (CDS, EDS, LDS, RDS). Pure: no I/O, no state.

Each function maps one plan type to one Envoy proto, so a reader can hold a plan dataclass and
its Envoy counterpart side by side. Envoy behaviours that shaped a choice are cited inline; the
measured ones are in design.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    health_check_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.core.v3 import extension_pb2 as core_extension_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.credential_injector.v3 import credential_injector_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.injected_credentials.generic.v3 import generic_pb2
from envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3 import (
    client_side_weighted_round_robin_pb2 as cswrr_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2
from envoy.type.matcher.v3 import value_pb2 as value_matcher_pb2
from envoy.type.v3 import percent_pb2, token_bucket_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2
from google.protobuf.message import Message

from policies.compile import LOCAL_SUFFIX
from policies.models import RateLimit
from policies.plan import FleetPlan, PlanCluster, PlanListener, PlanRoute, PlanVirtualHost
from xdsserver import resources

MODEL_METADATA_NAMESPACE = "envoy.lb"
"""Where json_to_metadata puts the body's ``model`` field (design.md: namespace envoy.lb)."""
MODEL_METADATA_KEY = "model"
AFFINITY_SUFFIX = "/affinity"
INTERNAL_SUFFIX = "/internal"
"""Suffix of the internal listener (and its cluster) in front of an authenticated provider."""
"""Suffix of the consistent-hash twin of a route cluster (same endpoints, same EDS resource)."""

_HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
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
_RETRY_ON = {
    "5xx": "5xx",
    "reset": "reset",
    "connect-failure": "connect-failure",
    "gateway-error": "gateway-error",
    "refused-stream": "refused-stream",
    "429": "retriable-status-codes",
}
LOCAL_RATELIMIT = "envoy.filters.http.local_ratelimit"
LUA = "envoy.filters.http.lua"
PREFIX_KEY_HEADER = "x-kvpilot-prefix-key"
"""Set by Envoy's Lua filter from the prompt's first characters when no session header is sent."""
TENANT_DESCRIPTOR = "tenant"
MAX_TENANTS = 10_000
"""Most distinct tenant buckets one route keeps per Envoy (least recently used are dropped)."""
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600}
RATE_LIMITED_BODY = {
    "error": {
        "message": "Rate limit reached for this route; retry after the interval in the "
        "x-ratelimit-reset header.",
        "type": "rate_limit_exceeded",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
UNKNOWN_MODEL_BODY = json.dumps(
    {
        "error": {
            "message": "The model in this request is not served here.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
)


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


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def _any(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _ads() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.V3,
    )


def translate(plan: FleetPlan) -> FleetResources:
    """All Envoy resources for one fleet."""
    clusters: list[cluster_pb2.Cluster] = []
    endpoints: list[endpoint_pb2.ClusterLoadAssignment] = []
    listeners = [translate_listener(listener) for listener in plan.listeners]
    behind_listener = frozenset(
        cluster.name for cluster in plan.clusters if cluster.kind == "dns" and cluster.auth
    )
    for cluster in plan.clusters:
        clusters.extend(
            translate_cluster(
                cluster,
                secrets_dir=plan.secrets_dir,
                trusted_ca_file=plan.trusted_ca_file,
                behind_listener=behind_listener,
            )
        )
        if cluster.kind == "eds":
            endpoints.append(translate_endpoints(cluster))
        elif cluster.kind == "dns" and cluster.auth is not None:
            listeners.append(_credential_listener(cluster, plan.secrets_dir))
            clusters.append(_internal_cluster(cluster))
    return FleetResources(
        clusters=tuple(clusters),
        endpoints=tuple(endpoints),
        listeners=tuple(listeners),
        routes=tuple(translate_route_configuration(listener) for listener in plan.listeners),
    )


# --------------------------------------------------------------------------------------------
# CDS and EDS
# --------------------------------------------------------------------------------------------


def translate_cluster(
    cluster: PlanCluster,
    *,
    secrets_dir: str = "/etc/envoy/secrets",
    trusted_ca_file: str = "/etc/ssl/certs/ca-certificates.crt",
    behind_listener: frozenset[str] = frozenset(),
) -> list[cluster_pb2.Cluster]:
    """The route's cluster, plus a consistent-hash twin when the route has session affinity.

    Both read the same ClusterLoadAssignment (``eds_cluster_config.service_name``), so a
    weight change is one EDS update. Requests with the session header go to the twin;
    requests without it keep the route's balancing mode instead of landing on a random host.
    """
    if cluster.kind == "aggregate":
        return _aggregate(cluster, behind_listener)
    if cluster.kind == "dns":
        return [_provider(cluster, secrets_dir, trusted_ca_file)]
    base = _cluster(cluster, cluster.name, trusted_ca_file)
    base.lb_policy = _LB_POLICY[cluster.balancing]
    if cluster.balancing == "orca":
        # load_balancing_policy takes precedence over lb_policy.
        base.load_balancing_policy.CopyFrom(_orca_policy())
    out = [base]
    if cluster.affinity is not None:
        twin = _cluster(cluster, cluster.name + AFFINITY_SUFFIX, trusted_ca_file)
        if cluster.affinity.algorithm == "maglev":
            twin.lb_policy = cluster_pb2.Cluster.MAGLEV
        else:
            twin.lb_policy = cluster_pb2.Cluster.RING_HASH
            twin.ring_hash_lb_config.minimum_ring_size.value = 1024
        if cluster.affinity.hash_balance_factor:
            # Bounded load: no host above factor% of the average in-flight load.
            twin.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value = (
                cluster.affinity.hash_balance_factor
            )
        out.append(twin)
    return out


ORCA_UTILIZATION_METRICS = ("named_metrics.kv_cache_usage_perc",)
"""Used when a report has no ``application_utilization``: vLLM's own ORCA header reports its
KV-cache use as a named metric."""


def _orca_policy() -> cluster_pb2.LoadBalancingPolicy:
    """Envoy's client-side weighted round robin: each Envoy weighs hosts by the ORCA load they
    report in ``endpoint-load-metrics`` response headers (weight = qps / utilization), so
    per-request load feedback needs no control-plane round trip.

    Envoy's defaults are tuned for slow-moving services: a 10 s blackout before a new host's
    reports count, recomputed every second. LLM load swings faster; a 1 s blackout and a
    0.5 s update period let weights follow within a couple of seconds while still averaging
    over many responses. Reports older than 60 s expire and the host falls back to the mean
    weight.
    """
    config = cswrr_pb2.ClientSideWeightedRoundRobin(
        blackout_period=_duration(1.0),
        weight_update_period=_duration(0.5),
        weight_expiration_period=_duration(60.0),
        metric_names_for_computing_utilization=list(ORCA_UTILIZATION_METRICS),
    )
    return cluster_pb2.LoadBalancingPolicy(
        policies=[
            cluster_pb2.LoadBalancingPolicy.Policy(
                typed_extension_config=core_extension_pb2.TypedExtensionConfig(
                    name="envoy.load_balancing_policies.client_side_weighted_round_robin",
                    typed_config=_any(config),
                )
            )
        ]
    )


def _aggregate(cluster: PlanCluster, behind_listener: frozenset[str]) -> list[cluster_pb2.Cluster]:
    """Failover from the route's replicas to external providers, in order.

    Envoy's aggregate cluster lays the members' priorities end to end, so health-based
    failover and retries with previous_priorities work across them. With session affinity a
    twin aggregate starts from the replicas' consistent-hash cluster instead.
    """
    members = tuple(
        _internal_name(member) if member in behind_listener else member
        for member in cluster.members
    )
    variants = [(cluster.name, members)]
    if cluster.affinity is not None:
        variants.append(
            (
                cluster.name + AFFINITY_SUFFIX,
                tuple(
                    member + AFFINITY_SUFFIX if member == cluster.name + LOCAL_SUFFIX else member
                    for member in members
                ),
            )
        )
    out = []
    for name, members in variants:
        aggregate = cluster_pb2.Cluster(
            name=name,
            connect_timeout=_duration(cluster.connect_timeout),
            lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        )
        aggregate.cluster_type.name = "envoy.clusters.aggregate"
        aggregate.cluster_type.typed_config.CopyFrom(
            _any(aggregate_pb2.ClusterConfig(clusters=list(members)))
        )
        out.append(aggregate)
    return out


def _provider(cluster: PlanCluster, secrets_dir: str, trusted_ca_file: str) -> cluster_pb2.Cluster:
    """An external provider: resolved by Envoy's DNS (EDS carries only IPs), over TLS, with
    its credential header added by Envoy from a secret file on the Envoy host."""
    out = _cluster(cluster, cluster.name, trusted_ca_file)
    out.ClearField("eds_cluster_config")
    # One name behind a CDN or load balancer: LOGICAL_DNS keeps one connection target at a
    # time; several endpoints: STRICT_DNS balances over all resolved addresses.
    out.type = (
        cluster_pb2.Cluster.LOGICAL_DNS
        if len(cluster.endpoints) == 1
        else cluster_pb2.Cluster.STRICT_DNS
    )
    out.dns_lookup_family = cluster_pb2.Cluster.V4_PREFERRED
    out.lb_policy = cluster_pb2.Cluster.ROUND_ROBIN
    assignment = translate_endpoints(cluster)
    assignment.cluster_name = cluster.name
    out.load_assignment.CopyFrom(assignment)
    return out


def _credential_listener(cluster: PlanCluster, secrets_dir: str) -> listener_pb2.Listener:
    """An Envoy internal listener in front of an authenticated provider.

    Envoy applies a cluster's upstream HTTP filters only when the route targets that cluster
    directly, not through an aggregate cluster (envoy#29318), and filters on the aggregate
    would hand the provider's key to the replicas too. So the aggregate reaches the provider
    through this listener, whose credential injector adds the header on this path only.
    Needs the ``envoy.bootstrap.internal_listener`` bootstrap extension (deploy/envoy/).
    """
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=_internal_name(cluster.name).replace("/", "_"),
        route_config=route_pb2.RouteConfiguration(
            name=_internal_name(cluster.name),
            virtual_hosts=[
                route_components_pb2.VirtualHost(
                    name="provider",
                    domains=["*"],
                    routes=[
                        route_components_pb2.Route(
                            match=route_components_pb2.RouteMatch(prefix="/"),
                            route=route_components_pb2.RouteAction(
                                cluster=cluster.name,
                                # The outer route owns timeouts and retries.
                                timeout=_duration(0),
                            ),
                        )
                    ],
                )
            ],
        ),
        http_filters=[
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.credential_injector",
                typed_config=_any(_credential_injector(cluster, secrets_dir)),
            ),
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.router", typed_config=_any(router_pb2.Router())
            ),
        ],
        stream_idle_timeout=_duration(0),
    )
    listener = listener_pb2.Listener(
        name=_internal_name(cluster.name),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=_any(manager),
                    )
                ]
            )
        ],
    )
    listener.internal_listener.SetInParent()
    return listener


def _internal_cluster(cluster: PlanCluster) -> cluster_pb2.Cluster:
    """The aggregate's member for an authenticated provider: its internal listener."""
    name = _internal_name(cluster.name)
    endpoint = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(
                envoy_internal_address=address_pb2.EnvoyInternalAddress(server_listener_name=name)
            ),
            # Keeps the outer route's auto_host_rewrite pointing at the provider's host.
            hostname=cluster.endpoints[0].hostname if cluster.endpoints else "",
        )
    )
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=_duration(cluster.connect_timeout),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint])],
        ),
    )


def _internal_name(provider_cluster: str) -> str:
    return provider_cluster + INTERNAL_SUFFIX


def _credential_injector(
    cluster: PlanCluster, secrets_dir: str
) -> credential_injector_pb2.CredentialInjector:
    assert cluster.auth is not None
    name = cluster.auth.secret_ref.name
    secret = secret_pb2.SdsSecretConfig(
        name=name,
        sds_config=config_source_pb2.ConfigSource(
            path_config_source=config_source_pb2.PathConfigSource(
                path=f"{secrets_dir.rstrip('/')}/{name}.yaml"
            ),
            resource_api_version=config_source_pb2.V3,
        ),
    )
    return credential_injector_pb2.CredentialInjector(
        # The provider's key replaces whatever a client sent in that header.
        overwrite=True,
        credential=core_extension_pb2.TypedExtensionConfig(
            name="envoy.http.injected_credentials.generic",
            typed_config=_any(generic_pb2.Generic(credential=secret, header=cluster.auth.header)),
        ),
    )


def _cluster(cluster: PlanCluster, name: str, trusted_ca_file: str) -> cluster_pb2.Cluster:
    out = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=_ads(), service_name=cluster.eds_service or cluster.name
        ),
        connect_timeout=_duration(cluster.connect_timeout),
    )
    # Apply a new host set at once; the 1 s default merge window delays failover.
    out.common_lb_config.update_merge_window.CopyFrom(_duration(0))
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
    out.typed_extension_protocol_options[_HTTP_PROTOCOL_OPTIONS].CopyFrom(_any(protocol_options))

    check = cluster.health_check
    if check.enabled:
        out.health_checks.append(
            health_check_pb2.HealthCheck(
                timeout=_duration(check.timeout),
                interval=_duration(check.interval),
                # Idle tiers are checked as often as busy ones: failover needs to know
                # whether priority 1 is healthy before traffic reaches it.
                no_traffic_interval=_duration(check.interval),
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
                interval=_duration(outlier.interval),
                base_ejection_time=_duration(outlier.base_ejection_time),
                # Envoy's default of 10% never ejects anything among fewer than 10 hosts.
                max_ejection_percent=wrappers_pb2.UInt32Value(value=outlier.max_ejection_percent),
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
        out.transport_socket.typed_config.CopyFrom(_any(context))
    return out


def translate_endpoints(cluster: PlanCluster) -> endpoint_pb2.ClusterLoadAssignment:
    """One ClusterLoadAssignment per route: tier k at priority k, grouped by locality."""
    groups: dict[tuple[int, str, str], list[endpoint_components_pb2.LbEndpoint]] = {}
    for endpoint in cluster.endpoints:
        groups.setdefault((endpoint.priority, endpoint.region, endpoint.zone), []).append(
            endpoint_components_pb2.LbEndpoint(
                endpoint=endpoint_components_pb2.Endpoint(
                    address=_socket_address(endpoint.address, endpoint.port),
                    hostname=endpoint.hostname,
                ),
                health_status=_HEALTH[endpoint.health],
                load_balancing_weight=wrappers_pb2.UInt32Value(value=endpoint.weight),
                metadata=base_pb2.Metadata(
                    filter_metadata={
                        "kvpilot": struct_pb2.Struct(
                            fields={"pool": struct_pb2.Value(string_value=endpoint.pool)}
                        )
                    }
                ),
            )
        )
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster.eds_service or cluster.name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                locality=base_pb2.Locality(region=region, zone=zone),
                priority=priority,
                lb_endpoints=lb_endpoints,
            )
            for (priority, region, zone), lb_endpoints in sorted(groups.items())
        ],
    )


def _socket_address(address: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=address, port_value=port)
    )


# --------------------------------------------------------------------------------------------
# LDS and RDS
# --------------------------------------------------------------------------------------------


def translate_listener(listener: PlanListener) -> listener_pb2.Listener:
    """A plain-HTTP listener whose routes come over RDS (route configuration of the same name)."""
    filters: list[hcm_pb2.HttpFilter] = []
    if listener.routes_by_model:
        filters.append(
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.json_to_metadata",
                typed_config=_any(_model_to_metadata()),
            )
        )
    if listener.rate_limited:
        # Off at the listener; routes with a rate limit turn it on in typed_per_filter_config.
        filters.append(
            hcm_pb2.HttpFilter(
                name=LOCAL_RATELIMIT,
                typed_config=_any(local_rate_limit_pb2.LocalRateLimit(stat_prefix="rate_limit")),
            )
        )
    if listener.prefix_hashing:
        # No code at the listener; routes with prompt-prefix affinity bring theirs.
        filters.append(hcm_pb2.HttpFilter(name=LUA, typed_config=_any(lua_pb2.Lua())))
    filters.append(
        hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=_any(router_pb2.Router()))
    )
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=listener.name,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=_ads(), route_config_name=listener.name),
        http_filters=filters,
        # Streams may stay silent while a long prompt is prefilled; the per-route idle
        # timeout governs instead.
        stream_idle_timeout=_duration(0),
        drain_timeout=_duration(listener.drain_timeout),
    )
    if listener.rate_limited:
        manager.local_reply_config.CopyFrom(_rate_limited_reply())
    if listener.access_log:
        manager.access_log.append(
            accesslog_pb2.AccessLog(
                name="envoy.access_loggers.stdout",
                typed_config=_any(stream_pb2.StdoutAccessLog()),
            )
        )
    return listener_pb2.Listener(
        name=listener.name,
        address=_socket_address(listener.address, listener.port),
        # json_to_metadata buffers the body under the route matched before the model is
        # known: the unknown-model direct response when the model is in the body alone. A
        # route's request_body_buffer_limit does not apply to a direct response, so without
        # this the connection's 1 MiB default answers long prompts with 413.
        per_connection_buffer_limit_bytes=wrappers_pb2.UInt32Value(
            value=min(listener.max_request_body_bytes, 2**32 - 1)
        ),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=_any(manager),
                    )
                ]
            )
        ],
    )


def _model_to_metadata() -> json_to_metadata_pb2.JsonToMetadata:
    """Copy the OpenAI ``model`` body field to dynamic metadata; the filter then clears the
    route cache so routes can match on it. Without the charset variant and empty content
    types, many clients' requests would skip the filter (design.md)."""
    rule = json_to_metadata_pb2.JsonToMetadata.Rule(
        selectors=[json_to_metadata_pb2.JsonToMetadata.Selector(key=MODEL_METADATA_KEY)],
        on_present=json_to_metadata_pb2.JsonToMetadata.KeyValuePair(
            metadata_namespace=MODEL_METADATA_NAMESPACE,
            key=MODEL_METADATA_KEY,
            type=json_to_metadata_pb2.JsonToMetadata.STRING,
        ),
    )
    return json_to_metadata_pb2.JsonToMetadata(
        request_rules=json_to_metadata_pb2.JsonToMetadata.MatchRules(
            rules=[rule],
            allow_content_types=["application/json", "application/json; charset=utf-8"],
            allow_empty_content_type=True,
        )
    )


def translate_route_configuration(listener: PlanListener) -> route_pb2.RouteConfiguration:
    """One virtual host per RoutingPolicy on this listener."""
    return route_pb2.RouteConfiguration(
        name=listener.name,
        virtual_hosts=[
            _virtual_host(vhost, listener.max_request_body_bytes)
            for vhost in listener.virtual_hosts
        ],
    )


def _virtual_host(vhost: PlanVirtualHost, body_limit: int) -> route_components_pb2.VirtualHost:
    routes: list[route_components_pb2.Route] = []
    for route in vhost.routes:
        routes.extend(_routes(route, vhost.model_header, body_limit))
    if vhost.routes_by_model:
        routes.append(_unknown_model_route())
    return route_components_pb2.VirtualHost(
        name=vhost.name, domains=list(vhost.domains), routes=routes
    )


def _routes(
    route: PlanRoute, model_header: str, body_limit: int
) -> Iterable[route_components_pb2.Route]:
    """Envoy route entries for one plan route.

    A route that selects by model gets two entries per model: the override header first, then
    the body field, which counts only when the override header is absent. With session affinity each of those is preceded by an entry that requires
    the session header and targets the consistent-hash cluster.
    """
    matches: list[route_components_pb2.RouteMatch] = []
    if route.models:
        for model in route.models:
            matches.append(_match(route, header=(model_header, model)))
            matches.append(_match(route, model=model, unless_header=model_header))
    else:
        matches.append(_match(route))
    affinity = route.affinity
    for index, match in enumerate(matches):
        if affinity is not None:
            yield _route_entry(
                route,
                f"{route.name}#{index}/affinity",
                _with_header(match, affinity.header),
                affinity=affinity.header,
                body_limit=body_limit,
            )
            if affinity.prefix_hash_chars:
                yield _route_entry(
                    route,
                    f"{route.name}#{index}/prefix",
                    _with_header(match, PREFIX_KEY_HEADER),
                    affinity=PREFIX_KEY_HEADER,
                    body_limit=body_limit,
                )
        entry = _route_entry(
            route, f"{route.name}#{index}", match, affinity=None, body_limit=body_limit
        )
        if affinity is not None and affinity.prefix_hash_chars:
            # No session header: the Lua filter derives a key from the prompt's first
            # characters and sets PREFIX_KEY_HEADER; changing headers clears Envoy's route
            # cache, so the request is matched again and takes the "/prefix" entry above.
            entry.typed_per_filter_config[LUA].CopyFrom(
                _any(
                    lua_pb2.LuaPerRoute(
                        source_code=base_pb2.DataSource(
                            inline_string=prefix_key_lua(
                                affinity.header, affinity.prefix_hash_chars
                            )
                        )
                    )
                )
            )
        yield entry


def _with_header(
    match: route_components_pb2.RouteMatch, header: str
) -> route_components_pb2.RouteMatch:
    out = route_components_pb2.RouteMatch()
    out.CopyFrom(match)
    out.headers.append(route_components_pb2.HeaderMatcher(name=header, present_match=True))
    return out


def prefix_key_lua(session_header: str, chars: int) -> str:
    """Lua run by Envoy on requests without a session header: a hash of the first ``chars``
    characters of the prompt (from the ``messages`` or ``prompt`` field on, as sent) becomes
    the PREFIX_KEY_HEADER, so requests that share a long prefix (a system prompt, a document)
    hash to the same replica and meet its prefix cache.

    The trade-off of ``chars``: too small and unrelated conversations that merely share a
    short system prompt all pile onto one replica (bounded load then spills them over); too
    large and requests sharing a long prefix still differ within the window and scatter.
    The hash is computed in Lua so the header stays short and printable whatever the prompt
    holds; Envoy then hashes the header onto the ring like a session ID.
    """
    return f"""-- kvpilot: prompt-prefix affinity key ({chars} characters)
function envoy_on_request(handle)
  local headers = handle:headers()
  if headers:get("{session_header}") ~= nil or headers:get("{PREFIX_KEY_HEADER}") ~= nil then
    return
  end
  local body = handle:body()
  if body == nil then
    return
  end
  local text = body:getBytes(0, math.min(body:length(), {chars} + 65536))
  local start = string.find(text, '"messages"', 1, true) or string.find(text, '"prompt"', 1, true)
  if start == nil then
    return
  end
  local window = string.sub(text, start, start + {chars} - 1)
  local hash = 7
  for i = 1, #window do
    hash = (hash * 31 + string.byte(window, i)) % 2147483647
  end
  -- Header handles taken before body() are invalid after it yields: fetch them again.
  handle:headers():add("{PREFIX_KEY_HEADER}", string.format("%x", hash))
end
"""


def _match(
    route: PlanRoute,
    *,
    header: tuple[str, str] | None = None,
    model: str | None = None,
    unless_header: str | None = None,
) -> route_components_pb2.RouteMatch:
    match = route_components_pb2.RouteMatch(prefix=route.path_prefix)
    for name, value in (*route.headers, *([header] if header else [])):
        match.headers.append(
            route_components_pb2.HeaderMatcher(
                name=name, string_match=string_pb2.StringMatcher(exact=value)
            )
        )
    if unless_header is not None:
        # Envoy takes the first entry that matches: without this, the body entry of an
        # earlier route would beat the override header's entry of a later route.
        match.headers.append(
            route_components_pb2.HeaderMatcher(
                name=unless_header, present_match=True, invert_match=True
            )
        )
    if model is not None:
        match.dynamic_metadata.append(
            metadata_pb2.MetadataMatcher(
                filter=MODEL_METADATA_NAMESPACE,
                path=[metadata_pb2.MetadataMatcher.PathSegment(key=MODEL_METADATA_KEY)],
                value=value_matcher_pb2.ValueMatcher(
                    string_match=string_pb2.StringMatcher(exact=model)
                ),
            )
        )
    return match


def _route_entry(
    route: PlanRoute,
    name: str,
    match: route_components_pb2.RouteMatch,
    *,
    affinity: str | None,
    body_limit: int,
) -> route_components_pb2.Route:
    """One route entry; ``affinity`` names the header to hash on (consistent-hash cluster)."""
    action = route_components_pb2.RouteAction(
        cluster=route.cluster + (AFFINITY_SUFFIX if affinity else ""),
        timeout=_duration(route.timeouts.request),
        idle_timeout=_duration(route.timeouts.idle),
        retry_policy=_retry_policy(route, affinity=affinity is not None),
    )
    if affinity:
        action.hash_policy.append(
            route_components_pb2.RouteAction.HashPolicy(
                header=route_components_pb2.RouteAction.HashPolicy.Header(header_name=affinity)
            )
        )
    if route.host_rewrite:
        # The chosen endpoint's hostname: a provider's name, or its pool's hostRewrite.
        # Endpoints without one keep the client's Host header.
        action.auto_host_rewrite.value = True
    out = route_components_pb2.Route(name=name, match=match, route=action)
    if route.rate_limit is not None:
        out.typed_per_filter_config[LOCAL_RATELIMIT].CopyFrom(
            _any(_rate_limit(route.rate_limit, name))
        )
    # Long prompts are the norm: let the model-routing filter buffer the whole body.
    out.request_body_buffer_limit.value = body_limit
    return out


def _retry_policy(route: PlanRoute, *, affinity: bool) -> route_components_pb2.RetryPolicy:
    retries = route.retries
    policy = route_components_pb2.RetryPolicy(
        retry_on=",".join(dict.fromkeys(_RETRY_ON[condition] for condition in retries.retry_on)),
        num_retries=wrappers_pb2.UInt32Value(value=retries.attempts),
        retry_host_predicate=[
            route_components_pb2.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=_any(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        # A consistent hash picks the same host again on retry unless asked to re-pick many
        # times; plain balancers need only a few attempts.
        host_selection_retry_max_attempts=50 if affinity else 5,
        retry_back_off=route_components_pb2.RetryPolicy.RetryBackOff(
            base_interval=_duration(retries.backoff_base),
            max_interval=_duration(retries.backoff_base * 10),
        ),
    )
    if "429" in retries.retry_on:
        policy.retriable_status_codes.append(429)
    if retries.per_try_timeout:
        policy.per_try_timeout.CopyFrom(_duration(retries.per_try_timeout))
    if route.tiers > 1:
        # Move to the next tier on retry even when the failed tier still looks healthy
        # (a single priority-0 host answering 429, for example).
        policy.retry_priority.CopyFrom(
            route_components_pb2.RetryPolicy.RetryPriority(
                name="envoy.retry_priorities.previous_priorities",
                typed_config=_any(
                    previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=1)
                ),
            )
        )
    return policy


def _rate_limit(limit: RateLimit, stat_name: str) -> local_rate_limit_pb2.LocalRateLimit:
    """A token bucket per route, or per tenant header value when the limit names one.

    Tenant buckets are dynamic descriptors: an entry with an empty value matches any value and
    each distinct value gets its own bucket of the same size.
    """
    bucket = _token_bucket(limit)
    always = percent_pb2.FractionalPercent(
        numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED
    )
    config = local_rate_limit_pb2.LocalRateLimit(
        stat_prefix="rate_limit",
        token_bucket=bucket,
        filter_enabled=base_pb2.RuntimeFractionalPercent(default_value=always),
        filter_enforced=base_pb2.RuntimeFractionalPercent(default_value=always),
        enable_x_ratelimit_headers=ratelimit_pb2.DRAFT_VERSION_03,
    )
    if limit.tenant_header:
        config.rate_limits.append(
            route_components_pb2.RateLimit(
                actions=[
                    route_components_pb2.RateLimit.Action(
                        request_headers=route_components_pb2.RateLimit.Action.RequestHeaders(
                            header_name=limit.tenant_header,
                            descriptor_key=TENANT_DESCRIPTOR,
                            skip_if_absent=True,
                        )
                    )
                ]
            )
        )
        config.descriptors.append(
            ratelimit_pb2.LocalRateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=TENANT_DESCRIPTOR, value="")],
                token_bucket=_token_bucket(limit),
            )
        )
        config.max_dynamic_descriptors.value = MAX_TENANTS
        # A tenant's request spends only its own bucket; requests without the header share
        # the route's bucket.
        config.always_consume_default_token_bucket.value = False
    return config


def _token_bucket(limit: RateLimit) -> token_bucket_pb2.TokenBucket:
    return token_bucket_pb2.TokenBucket(
        max_tokens=limit.burst or limit.requests,
        tokens_per_fill=wrappers_pb2.UInt32Value(value=limit.requests),
        fill_interval=_duration(_UNIT_SECONDS[limit.unit]),
    )


def _rate_limited_reply() -> hcm_pb2.LocalReplyConfig:
    """Envoy's own 429s (rate limits) answered in OpenAI's error format; 429s from upstreams
    pass through untouched because local reply mappers only see local replies."""
    body = struct_pb2.Struct()
    body.update(RATE_LIMITED_BODY)
    return hcm_pb2.LocalReplyConfig(
        mappers=[
            hcm_pb2.ResponseMapper(
                filter=accesslog_pb2.AccessLogFilter(
                    status_code_filter=accesslog_pb2.StatusCodeFilter(
                        comparison=accesslog_pb2.ComparisonFilter(
                            op=accesslog_pb2.ComparisonFilter.EQ,
                            value=base_pb2.RuntimeUInt32(
                                default_value=429, runtime_key="kvpilot.rate_limited_status"
                            ),
                        )
                    )
                ),
                body_format_override=substitution_format_string_pb2.SubstitutionFormatString(
                    json_format=body
                ),
            )
        ]
    )


def _unknown_model_route() -> route_components_pb2.Route:
    """Requests for a model no route serves get OpenAI's 404, not an empty 503."""
    return route_components_pb2.Route(
        name="unknown-model",
        match=route_components_pb2.RouteMatch(prefix="/"),
        direct_response=route_components_pb2.DirectResponseAction(
            status=404, body=base_pb2.DataSource(inline_string=UNKNOWN_MODEL_BODY)
        ),
        response_headers_to_add=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="content-type", value="application/json"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
    )


__all__ = [
    "AFFINITY_SUFFIX",
    "FleetResources",
    "translate",
    "translate_cluster",
    "translate_endpoints",
    "translate_listener",
    "translate_route_configuration",
]
