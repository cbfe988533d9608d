"""Policy objects, their validation, and compilation to a routing plan (no I/O)."""

from policies.compile import RouteMemo, compile_plan
from policies.models import (
    API_VERSION,
    KIND_PATHS,
    KINDS,
    PATH_KINDS,
    Budget,
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
from policies.plan import DEFAULT_FLEET, Diagnostic, FleetPlan, RoutingPlan
from policies.state import PolicyState
from policies.validate import FieldError, PolicyError, decode_documents, load_objects, parse_object

__all__ = [
    "API_VERSION",
    "DEFAULT_FLEET",
    "KINDS",
    "KIND_PATHS",
    "PATH_KINDS",
    "Budget",
    "Diagnostic",
    "Endpoint",
    "EndpointHealth",
    "FieldError",
    "Fleet",
    "FleetPlan",
    "PolicyError",
    "PolicyObject",
    "PolicyState",
    "Pool",
    "Rollout",
    "RouteMemo",
    "RoutingPlan",
    "RoutingPolicy",
    "cluster_name",
    "compile_plan",
    "decode_documents",
    "kind_named",
    "listener_name",
    "load_objects",
    "parse_object",
]
