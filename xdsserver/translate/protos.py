"""Small builders shared by the translation modules: durations, Any packing, config sources."""

from __future__ import annotations

from envoy.config.core.v3 import address_pb2, config_source_pb2
from envoy.config.listener.v3 import listener_components_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2,
)
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message

HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
"""Key of a cluster's HTTP protocol options in ``typed_extension_protocol_options``."""


def duration(seconds: float) -> duration_pb2.Duration:
    """Seconds as a protobuf Duration (nanosecond precision)."""
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def pack(message: Message) -> any_pb2.Any:
    """A message packed into an Any, as Envoy's typed_config fields take it."""
    packed = any_pb2.Any()
    # Deterministic bytes inside the Any too: map fields (Struct, typed_per_filter_config)
    # would otherwise serialize in an order that differs between processes, and with it the
    # content-hash version of the whole resource.
    packed.Pack(message, deterministic=True)
    return packed


def ads_source() -> config_source_pb2.ConfigSource:
    """A config source that says "over the same ADS stream"."""
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.V3,
    )


def socket_address(address: str, port: int) -> address_pb2.Address:
    """An IP (or, for DNS clusters, host name) and port."""
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=address, port_value=port)
    )


def http_filter_chain(
    manager: http_connection_manager_pb2.HttpConnectionManager,
) -> listener_components_pb2.FilterChain:
    """A listener's filter chain that hands every connection to `manager`."""
    return listener_components_pb2.FilterChain(
        filters=[
            listener_components_pb2.Filter(
                name="envoy.filters.network.http_connection_manager",
                typed_config=pack(manager),
            )
        ]
    )
