"""External provider pools: a DNS cluster over TLS, and for a provider with a credential header,
the internal listener that adds it on that path only."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    config_source_pb2,
)
from envoy.config.core.v3 import extension_pb2 as core_extension_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.credential_injector.v3 import credential_injector_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.injected_credentials.generic.v3 import generic_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2

from compiler.plan import PlanCluster
from xdsserver.translate.clusters import INTERNAL_SUFFIX, cluster_base, translate_endpoints
from xdsserver.translate.listeners import local_replies
from xdsserver.translate.metadata import POOL_METADATA_KEY, POOL_METADATA_NAMESPACE
from xdsserver.translate.protos import duration, http_filter_chain, pack


def provider_cluster(cluster: PlanCluster, trusted_ca_file: str) -> cluster_pb2.Cluster:
    """An external provider: resolved by Envoy's DNS (EDS carries only IPs), over TLS. Its
    credential header, if any, is added on the way in by ``credential_listener``."""
    out = cluster_base(cluster, cluster.name, trusted_ca_file)
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
    out.load_assignment.CopyFrom(translate_endpoints(cluster))
    if cluster.endpoints:
        for locality in out.load_assignment.endpoints:
            for lb_endpoint in locality.lb_endpoints:
                _tag_pool(lb_endpoint, cluster.endpoints[0].pool)
    return out


def _tag_pool(lb_endpoint: endpoint_components_pb2.LbEndpoint, pool: str) -> None:
    """Name the endpoint's pool in its metadata: the access log reports it with each attempt
    (``POOL_TAG``), so kvpilot knows which paid pool answered 429."""
    lb_endpoint.metadata.filter_metadata[POOL_METADATA_NAMESPACE].fields[
        POOL_METADATA_KEY
    ].string_value = pool


def credential_listener(cluster: PlanCluster, secrets_dir: str) -> listener_pb2.Listener:
    """An Envoy internal listener in front of an authenticated provider.

    Envoy applies a cluster's upstream HTTP filters only when the route targets that cluster
    directly, not through an aggregate cluster (envoy#29318), and filters on the aggregate
    would hand the provider's key to the replicas too. So the aggregate reaches the provider
    through this listener, whose credential injector adds the header on this path only.
    Needs the ``envoy.bootstrap.internal_listener`` bootstrap extension (deploy/envoy/).
    """
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=internal_name(cluster.name).replace("/", "_"),
        route_config=route_pb2.RouteConfiguration(
            name=internal_name(cluster.name),
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
                                timeout=duration(0),
                            ),
                        )
                    ],
                )
            ],
        ),
        http_filters=[
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.credential_injector",
                typed_config=pack(_credential_injector(cluster, secrets_dir)),
            ),
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.router", typed_config=pack(router_pb2.Router())
            ),
        ],
        stream_idle_timeout=duration(0),
        # Its own 5xx (provider unreachable, TLS failure) reach the client as the provider's
        # answer: in the same OpenAI format as the outer listener's.
        local_reply_config=local_replies(rate_limited=False),
    )
    listener = listener_pb2.Listener(
        name=internal_name(cluster.name),
        filter_chains=[http_filter_chain(manager)],
    )
    listener.internal_listener.SetInParent()
    return listener


def internal_cluster(cluster: PlanCluster) -> cluster_pb2.Cluster:
    """The aggregate's member for an authenticated provider: its internal listener."""
    name = internal_name(cluster.name)
    endpoint = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(
                envoy_internal_address=address_pb2.EnvoyInternalAddress(server_listener_name=name)
            ),
            # Keeps the outer route's auto_host_rewrite pointing at the provider's host.
            hostname=cluster.endpoints[0].hostname if cluster.endpoints else "",
        )
    )
    if cluster.endpoints:
        _tag_pool(endpoint, cluster.endpoints[0].pool)
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration(cluster.connect_timeout),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint])],
        ),
    )


def internal_name(provider_cluster: str) -> str:
    """The internal listener (and cluster) in front of an authenticated provider cluster."""
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
            typed_config=pack(generic_pb2.Generic(credential=secret, header=cluster.auth.header)),
        ),
    )
