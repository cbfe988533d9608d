"""Where the request's model travels as Envoy metadata: json_to_metadata writes the body's
``model`` to ``envoy.lb`` (design.md), the router merges that namespace into a route's
metadata match, and subset load balancing and tracing read it from there. And where a paid
pool's endpoints carry their pool's name, for the access logs that report which pool
answered."""

from envoy.type.metadata.v3 import metadata_pb2 as metadata_kind_pb2
from envoy.type.tracing.v3 import custom_tag_pb2

MODEL_METADATA_NAMESPACE = "envoy.lb"
"""Where json_to_metadata puts the body's ``model`` field (design.md: namespace envoy.lb)."""
MODEL_METADATA_KEY = "model"
"""The key of the model: in the request's metadata, and in the endpoints' (the models each
serves, for subset load balancing)."""

POOL_METADATA_NAMESPACE = "kvpilot"
POOL_METADATA_KEY = "pool"
"""Endpoint metadata ``kvpilot.pool``: the pool of an external provider's endpoints, whose
address is a DNS name kvpilot cannot match against the upstream address Envoy logs."""
POOL_TAG = "kvpilot.pool"
"""Access-log tag with the pool of the upstream host (external providers carry it)."""


def pool_tag() -> custom_tag_pb2.CustomTag:
    """An access log's ``POOL_TAG``: the ``kvpilot.pool`` metadata of the upstream host that
    answered. Absent for hosts without it (replicas, matched by their address instead)."""
    return custom_tag_pb2.CustomTag(
        tag=POOL_TAG,
        metadata=custom_tag_pb2.CustomTag.Metadata(
            kind=metadata_kind_pb2.MetadataKind(host=metadata_kind_pb2.MetadataKind.Host()),
            metadata_key=metadata_kind_pb2.MetadataKey(
                key=POOL_METADATA_NAMESPACE,
                path=[metadata_kind_pb2.MetadataKey.PathSegment(key=POOL_METADATA_KEY)],
            ),
        ),
    )


GATE_UPSTREAM = "x-kvpilot-gate-upstream"
"""Set by a route's gate (``translate.gate``) on every answer: the replica's ``address:port``.
Behind the gate the host Envoy logs is the gate's internal listener, so the usage log reads
this header to count spend by the replica's pool."""

PREFIX_KEY_HEADER = "x-kvpilot-prefix-key"
"""Set by Envoy's Lua filter from the prompt's first characters when no session header is sent."""
