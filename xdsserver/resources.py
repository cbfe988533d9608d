"""Envoy resource type URLs and the `Resource` value the snapshot cache hands to ADS streams.

A `Resource` is serialized and packed into a `google.protobuf.Any` exactly once, when a snapshot
is built. Every stream that sends it reuses the same `Any`: marshaling dominates a control
plane's CPU under load (go-control-plane caches serialized responses for the same reason).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import any_pb2

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"

PUSH_ORDER = (CLUSTER, ENDPOINT, LISTENER, ROUTE)
"""Make-before-break on ADS: a cluster exists (and has endpoints) before a route points at it."""

REMOVE_ORDER = (LISTENER, ROUTE, CLUSTER, ENDPOINT)
"""Removals go referrer first: nothing still points at a cluster when it disappears."""

WILDCARD_TYPES = frozenset({CLUSTER, LISTENER})
"""Types an Envoy subscribes to as a whole (empty or "*" names); EDS and RDS are always named."""

SHORT_NAMES = {CLUSTER: "CDS", ENDPOINT: "EDS", LISTENER: "LDS", ROUTE: "RDS"}

_TYPE_PREFIX = "type.googleapis.com/"
_VERSION_HEX_CHARS = 16


def short_name(type_url: str) -> str:
    """CDS/EDS/LDS/RDS for the four ADS types, else the message name (for logs and metrics)."""
    return SHORT_NAMES.get(type_url) or type_url.rsplit(".", 1)[-1]


def type_url_of(message: Any) -> str:
    """The type URL of a proto message, as Envoy expects it in `type_url`."""
    return _TYPE_PREFIX + str(message.DESCRIPTOR.full_name)


def resource_name(message: Any) -> str:
    """The name Envoy uses for a resource: what it subscribes to and what must be unique."""
    full_name = message.DESCRIPTOR.full_name
    if full_name == "envoy.config.endpoint.v3.ClusterLoadAssignment":
        return str(message.cluster_name)
    return str(message.name)


def content_version(items: Iterable[tuple[str, str]]) -> str:
    """A short content hash over (name, version) pairs, independent of their order.

    Equal content gives an equal version on every kvpilot replica and after restarts, so an
    Envoy that reconnects to another replica is not sent what it already has.
    """
    digest = hashlib.sha256()
    for name, version in sorted(items):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(version.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:_VERSION_HEX_CHARS]


@dataclass(frozen=True, slots=True)
class Resource:
    """One Envoy resource, serialized once and shared by every stream that sends it."""

    name: str
    """Cluster.name, ClusterLoadAssignment.cluster_name, Listener.name or RouteConfiguration.name."""
    type_url: str
    version: str
    """Short hex hash of the deterministic serialization: equal bytes, equal version."""
    body: any_pb2.Any = field(repr=False)
    """The packed message. Shared: never mutate it."""
    message: Any = field(repr=False)
    """The proto itself, for status and debug views. Shared: never mutate it."""

    @classmethod
    def from_message(cls, message: Any) -> Resource:
        """Serialize `message` (deterministically) and pack it."""
        type_url = type_url_of(message)
        value = message.SerializeToString(deterministic=True)
        version = hashlib.sha256(value).hexdigest()[:_VERSION_HEX_CHARS]
        body = any_pb2.Any(type_url=type_url, value=value)
        return cls(
            name=resource_name(message),
            type_url=type_url,
            version=version,
            body=body,
            message=message,
        )
