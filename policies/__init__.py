"""Policy objects and their validation (no I/O): the models, the names derived from them
and the JSON document reader. The live signals are ``signals``; the plan is ``compiler``."""

from policies.models import (
    API_VERSION,
    CAPACITIES,
    KIND_PATHS,
    KINDS,
    PATH_KINDS,
    Budget,
    Capacity,
    Endpoint,
    EndpointHealth,
    Fleet,
    PolicyObject,
    Pool,
    Rollout,
    RoutingPolicy,
    kind_named,
)
from policies.names import cluster_name, listener_name
from policies.validate import FieldError, PolicyError, decode_documents, load_objects, parse_object

__all__ = [
    "API_VERSION",
    "CAPACITIES",
    "KINDS",
    "KIND_PATHS",
    "PATH_KINDS",
    "Budget",
    "Capacity",
    "Endpoint",
    "EndpointHealth",
    "FieldError",
    "Fleet",
    "PolicyError",
    "PolicyObject",
    "Pool",
    "Rollout",
    "RoutingPolicy",
    "cluster_name",
    "decode_documents",
    "kind_named",
    "listener_name",
    "load_objects",
    "parse_object",
]
