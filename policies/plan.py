"""The routing plan: what every fleet of Envoys should do, as plain immutable data.

``policies.compile`` builds it from validated objects, registered endpoints and telemetry;
``xdsserver.translate`` turns it into Envoy resources. Nothing here does I/O, and nothing here
knows about protobuf: the plan is what a reviewer reads to see what kvpilot decided.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from policies.models import (
    TLS,
    AuthHeader,
    Balancing,
    CircuitBreakers,
    EndpointHealth,
    HealthCheck,
    OutlierDetection,
    Protocol,
    RateLimit,
    Retries,
    SessionAffinity,
    Timeouts,
)
from policies.weights import WeightDecision

DEFAULT_FLEET = "default"
"""The fleet whose config an Envoy gets when its node.cluster has no config of its own."""


class PlanEndpoint(NamedTuple):
    """One upstream host in one priority of a cluster.

    A named tuple rather than a frozen dataclass: a fleet has one per endpoint and route, and a
    tuple is built several times faster (a frozen dataclass sets each field through
    ``object.__setattr__``), which at 10,000 endpoints is a good part of a compile."""

    pool: str
    address: str
    port: int
    weight: int
    priority: int
    health: EndpointHealth = "healthy"
    region: str = ""
    zone: str = ""
    hostname: str = ""
    """Host header for this endpoint when its pool rewrites it (Envoy's auto_host_rewrite)."""


ClusterKind = Literal["eds", "dns", "aggregate"]


@dataclass(frozen=True, slots=True)
class PlanCluster:
    """An Envoy cluster.

    - ``eds``: the route's replicas, tier k at priority k, endpoints over EDS;
    - ``dns``: one external provider pool, resolved by Envoy (EDS carries only IP addresses);
    - ``aggregate``: failover across ``members`` in order, when a route ends in providers.
    """

    name: str
    protocol: Protocol
    balancing: Balancing
    affinity: SessionAffinity | None
    connect_timeout: float
    health_check: HealthCheck
    outlier_detection: OutlierDetection
    circuit_breakers: CircuitBreakers
    tls: TLS | None
    auth: AuthHeader | None
    endpoints: tuple[PlanEndpoint, ...]
    kind: ClusterKind = "eds"
    eds_service: str = ""
    """Name of the ClusterLoadAssignment an ``eds`` cluster reads (default: its own name)."""
    members: tuple[str, ...] = ()
    """Clusters of an ``aggregate``, highest priority first."""


@dataclass(frozen=True, slots=True)
class PlanRoute:
    """One route entry of a virtual host."""

    name: str
    cluster: str
    models: tuple[str, ...]
    path_prefix: str
    headers: tuple[tuple[str, str], ...]
    affinity: SessionAffinity | None
    retries: Retries
    timeouts: Timeouts
    rate_limit: RateLimit | None
    host_rewrite: bool
    """Rewrite the Host header to the chosen endpoint's hostname (providers, hostRewrite)."""
    tiers: int


@dataclass(frozen=True, slots=True)
class PlanVirtualHost:
    """The routes of one RoutingPolicy on one listener."""

    name: str
    domains: tuple[str, ...]
    model_header: str
    routes: tuple[PlanRoute, ...]

    @property
    def routes_by_model(self) -> bool:
        """True when some route selects requests by model name."""
        return any(route.models for route in self.routes)


@dataclass(frozen=True, slots=True)
class PlanListener:
    """A listener and its route configuration (both named after the port)."""

    name: str
    address: str
    port: int
    virtual_hosts: tuple[PlanVirtualHost, ...]
    max_request_body_bytes: int
    access_log: bool
    drain_timeout: float

    @property
    def routes_by_model(self) -> bool:
        """True when the listener must read the request body's ``model`` field."""
        return any(vhost.routes_by_model for vhost in self.virtual_hosts)

    @property
    def prefix_hashing(self) -> bool:
        """True when some route hashes a prompt prefix for affinity (Envoy's Lua filter)."""
        return any(
            route.affinity is not None and route.affinity.prefix_hash_chars > 0
            for vhost in self.virtual_hosts
            for route in vhost.routes
        )

    @property
    def rate_limited(self) -> bool:
        """True when some route on the listener has a rate limit."""
        return any(
            route.rate_limit is not None for vhost in self.virtual_hosts for route in vhost.routes
        )


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """Everything one fleet of Envoys is sent."""

    fleet: str
    listeners: tuple[PlanListener, ...]
    clusters: tuple[PlanCluster, ...]
    secrets_dir: str = "/etc/envoy/secrets"
    """Where this fleet's Envoys find secret files (SDS) named by pools' ``auth``."""
    trusted_ca_file: str = "/etc/ssl/certs/ca-certificates.crt"
    """CA bundle on this fleet's Envoy hosts for TLS pools without a caFile of their own."""


Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """Something a user should fix; the rest of the plan still ships (best effort)."""

    severity: Severity
    kind: str
    name: str
    message: str
    path: str = ""

    def __str__(self) -> str:
        where = f"{self.kind}/{self.name}" + (f" at {self.path}" if self.path else "")
        return f"{self.severity}: {where}: {self.message}"


@dataclass(frozen=True, slots=True)
class RoutingPlan:
    """The compiled plan for every fleet, plus what could not be compiled and why."""

    fleets: tuple[FleetPlan, ...]
    diagnostics: tuple[Diagnostic, ...] = field(default=())
    weights: Mapping[str, Mapping[str, WeightDecision]] = field(default_factory=dict, hash=False)
    """What telemetry decided, for telemetry-balanced pools: pool -> endpoint key -> decision."""

    def fleet(self, name: str) -> FleetPlan | None:
        """The plan of fleet ``name``, or None."""
        for plan in self.fleets:
            if plan.fleet == name:
                return plan
        return None
