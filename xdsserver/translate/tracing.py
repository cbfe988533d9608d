"""OpenTelemetry tracing: Envoy's tracer on a fleet's listeners, the collector's cluster, and
the span attributes each route entry adds.

Envoy makes the span (one per sampled request, the HTTP connection manager's), continues a
client's W3C ``traceparent`` and sends the trace context on to the replica; kvpilot only says
where spans go, how many requests are sampled and what each span says about kvpilot's
decision. Attributes set by the listener (the same for every request): the model asked for
(the body's ``model``, which json_to_metadata put in ``envoy.lb``), the chosen endpoint, and
the tenant when the route's policy names a tenant header. Attributes set by each route entry
(literals, since each entry is one decision): the route, its pools, the model it routes to,
the service class, and which hash picked the replica (``session``, ``prefix`` or ``none``).
"""

from __future__ import annotations

from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import grpc_service_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.config.trace.v3 import http_tracer_pb2, opentelemetry_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.tracing.v3 import custom_tag_pb2
from envoy.type.v3 import percent_pb2

from policies.models import Tracing, is_ip
from xdsserver.translate.metadata import MODEL_METADATA_KEY, MODEL_METADATA_NAMESPACE
from xdsserver.translate.protos import HTTP_PROTOCOL_OPTIONS, duration, pack, socket_address

COLLECTOR_CLUSTER = "kvpilot_otel_collector"
"""The cluster that reaches a fleet's OpenTelemetry collector."""

ATTRIBUTE_PREFIX = "kvpilot."
"""Prefix of the attributes kvpilot adds to Envoy's spans (besides OpenTelemetry's GenAI
``gen_ai.request.model``)."""


def collector_cluster(tracing: Tracing) -> cluster_pb2.Cluster:
    """The collector's cluster: OTLP/gRPC needs HTTP/2; a DNS name is resolved by Envoy."""
    options = http_protocol_options_pb2.HttpProtocolOptions()
    options.explicit_http_config.http2_protocol_options.CopyFrom(
        protocol_pb2.Http2ProtocolOptions()
    )
    cluster = cluster_pb2.Cluster(
        name=COLLECTOR_CLUSTER,
        type=cluster_pb2.Cluster.STATIC if is_ip(tracing.host) else cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=duration(1.0),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=COLLECTOR_CLUSTER,
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(
                    lb_endpoints=[
                        endpoint_components_pb2.LbEndpoint(
                            endpoint=endpoint_components_pb2.Endpoint(
                                address=socket_address(tracing.host, tracing.port)
                            )
                        )
                    ]
                )
            ],
        ),
    )
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(pack(options))
    return cluster


def _tag(name: str, **kind: Any) -> custom_tag_pb2.CustomTag:
    return custom_tag_pb2.CustomTag(tag=name, **kind)


def listener_tracing(
    tracing: Tracing, tenant_headers: tuple[str, ...]
) -> hcm_pb2.HttpConnectionManager.Tracing:
    """The connection manager's tracing: the OpenTelemetry provider, the sampling rate, and
    the attributes that are the same for every route."""
    provider = http_tracer_pb2.Tracing.Http(
        name="envoy.tracers.opentelemetry",
        typed_config=pack(
            opentelemetry_pb2.OpenTelemetryConfig(
                grpc_service=grpc_service_pb2.GrpcService(
                    envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                        cluster_name=COLLECTOR_CLUSTER
                    ),
                    timeout=duration(1.0),
                ),
                service_name=tracing.service_name,
            )
        ),
    )
    tags = [
        _tag(
            "gen_ai.request.model",
            metadata=custom_tag_pb2.CustomTag.Metadata(
                kind=metadata_pb2.MetadataKind(request=metadata_pb2.MetadataKind.Request()),
                metadata_key=metadata_pb2.MetadataKey(
                    key=MODEL_METADATA_NAMESPACE,
                    path=[metadata_pb2.MetadataKey.PathSegment(key=MODEL_METADATA_KEY)],
                ),
            ),
        ),
        _tag(ATTRIBUTE_PREFIX + "endpoint", value="%UPSTREAM_HOST%"),
    ]
    tags += [
        _tag(ATTRIBUTE_PREFIX + "tenant", request_header=custom_tag_pb2.CustomTag.Header(name=h))
        for h in tenant_headers
    ]
    return hcm_pb2.HttpConnectionManager.Tracing(
        provider=provider,
        random_sampling=percent_pb2.Percent(value=tracing.sampling),
        # A client's own x-client-trace-id does not force a trace.
        client_sampling=percent_pb2.Percent(value=0),
        overall_sampling=percent_pb2.Percent(value=100),
        custom_tags=tags,
    )


def entry_tracing(
    *,
    sampling: float,
    route: str,
    pools: tuple[str, ...],
    model: str,
    service_class: str,
    hashed: str,
) -> route_components_pb2.Tracing:
    """The attributes one route entry adds to its spans: the decision it stands for."""
    literals = {
        "route": route,
        "pool": ",".join(pools),
        "model_served": model,
        "service_class": service_class,
        "hash": hashed,
    }
    return route_components_pb2.Tracing(
        # A route's tracing brings its own sampling, 100% unless set: the fleet's rate again.
        random_sampling=percent_pb2.FractionalPercent(
            numerator=round(sampling * 10_000),
            denominator=percent_pb2.FractionalPercent.MILLION,
        ),
        client_sampling=percent_pb2.FractionalPercent(numerator=0),
        overall_sampling=percent_pb2.FractionalPercent(
            numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED
        ),
        custom_tags=[
            _tag(
                ATTRIBUTE_PREFIX + name,
                literal=custom_tag_pb2.CustomTag.Literal(value=value),
            )
            for name, value in literals.items()
            # Envoy refuses an empty literal (the route configuration is NACKed): a route
            # without service classes, or an entry that takes any model, leaves it out.
            if value
        ],
    )
