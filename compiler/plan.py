"""The routing plan: what every fleet of Envoys should do, as plain immutable data.

``compiler.compile`` builds it from validated objects, registered endpoints and telemetry;
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
    ClassAction,
    ClassBudget,
    ClassQueue,
    EndpointHealth,
    HealthCheck,
    OutlierDetection,
    Protocol,
    RateLimit,
    Retries,
    SessionAffinity,
    Timeouts,
    Tracing,
)
from signals.admission import AdmissionDecision
from signals.difficultyshare import ShareDecision
from signals.overflow import OverflowDecision
from signals.saturation import SaturationDecision
from signals.spill import SpillDecision
from signals.weights import WeightDecision

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
    hash_key: str = ""
    """Where consistent hashing places this endpoint on the ring (the endpoint's ``name``);
    empty: by its address."""
    models: tuple[str, ...] = ()
    """Models and LoRA adapters this endpoint serves, sorted, when its cluster routes by
    them (``PlanCluster.model_subsets``): its pool's list, or what its agent reports."""
    capacity: str = ""
    """How the replica's machine is bought (``Endpoint.capacity``); empty when unknown."""


ClusterKind = Literal["eds", "dns", "aggregate", "gate"]


@dataclass(frozen=True, slots=True)
class PlanCluster:
    """An Envoy cluster.

    - ``eds``: the route's replicas, tier k at priority k, endpoints over EDS;
    - ``dns``: one external provider pool, resolved by Envoy (EDS carries only IP addresses);
    - ``aggregate``: failover across ``members`` in order, when a route ends in providers;
    - ``gate``: a route's owned replicas behind an internal listener, whose circuit breaker
      (``circuit_breakers.max_requests``) answers at once, with a header the route retries
      on, when their batch slots are taken (``overflow.maxInFlight``).
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
    queues: tuple[tuple[str, ClassQueue], ...] = ()
    """Twins of an ``eds`` cluster (same endpoints, same EDS resource) whose circuit breakers
    hold queued service classes: (twin cluster name, bounds)."""
    model_subsets: bool = False
    """Requests go to the endpoints that serve the model they ask for (each endpoint's
    ``models``), any endpoint when none does: adapter-aware routing."""
    overprovisioning: int = 0
    """The ClusterLoadAssignment's overprovisioning factor in percent, when kvpilot spills a
    saturated locality (``signals.spill``); 0: Envoy's default (140), not sent."""


@dataclass(frozen=True, slots=True)
class PlanClass:
    """One service class on one route: how Envoy tells its requests and what it admits."""

    name: str
    headers: tuple[tuple[str, str], ...]
    """Exact header matches; with ``tenants``, all must hold. Both empty: the route's
    fallback class, which takes whatever no other class claimed."""
    tenants: tuple[str, ...]
    action: ClassAction
    admitted: float
    """Share of the class's requests Envoy admits, 0 to 1; the rest are shed or diverted."""
    retry_after: int
    """Seconds, for the Retry-After of shed requests."""
    target_cluster: str = ""
    """Cluster that takes diverted requests (``action: divert``) or queues them (``queue``)."""
    budget: ClassBudget | None = None

    @property
    def sheds(self) -> bool:
        """True when some of the class's requests are turned away or diverted now."""
        return self.action != "admit" and self.admitted < 1.0


@dataclass(frozen=True, slots=True)
class PlanOverflow:
    """Where a route's overflow goes and how much of it (``signals.overflow``)."""

    cluster: str
    """The aggregate cluster of the paid pool that takes the overflow (then the other paid
    pools, then the route's replicas, for retries); empty when no paid pool can take any."""
    plain: float
    """Share of the requests without a session header sent there, 0 to 1."""
    sessions: float
    """Share of the requests with a session header sent there, 0 to 1."""
    members: int = 1
    """Clusters in that aggregate: retries move across them."""
    gate: str = ""
    """The route's gate (a ``gate`` cluster, ``overflow.maxInFlight``): its requests try the
    owned replicas through it first, and the ones it turns away move on to the paid pools
    (without a session) or to their replica's queue (with one). Empty: no gate."""
    gate_conversations: bool = False
    """Conversations the gate turns away go to the paid pools too (``conversations: with``),
    not to their replica's queue."""
    arrivals: bool = False
    """The share follows the route's arrival rate (``overflow.signal: arrivals``): its
    listener reports every upstream attempt's start and end (``PlanListener.arrivals_log``)."""


@dataclass(frozen=True, slots=True)
class PlanBudgetBlock:
    """A tenant past its budget on one route: Envoy answers its requests 429 (or sends them
    to ``divert_cluster``) until ``reset_at``."""

    budget: str
    tenant: str
    service_class: str
    """Only this class's requests (a class with a match of its own); empty: all."""
    model: str
    """Only requests for this model (on a route that selects by model); empty: all."""
    reset_at: int
    """Unix time the budget's window ends."""
    message: str
    divert_cluster: str = ""


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
    served_models: tuple[str, ...] = ()
    """What a client may ask this route for (sorted): its ``match.models``, or without them
    the ``models`` of its pools. Listed by ``GET /v1/models``."""
    classes: tuple[PlanClass, ...] = ()
    """Service classes in the order Envoy tries them, the route's fallback class last; empty
    when the policy declares none."""
    tenant_header: str = ""
    """Header naming the tenant, for class matches by tenant and class budgets."""
    saturated: bool = False
    """Session requests take the affinity cluster's saturated twin (its tighter bounded load,
    ``SessionAffinity.saturated_hash_balance_factor``)."""
    model_subsets: bool = False
    """The cluster picks among the endpoints that serve the asked model; each model's entries
    name it (a request that names its model in the override header has no body metadata)."""
    any_model: bool = False
    """A ``poolModels`` route whose adapter fallback is ``base``: besides its models, it takes
    requests for any model, after every other route of its virtual host, so an adapter that
    no replica has loaded reaches replicas that can load it."""
    adapters: tuple[tuple[str, str], ...] = ()
    """(adapter, its base model) for the adapters in ``served_models``, for ``GET
    /v1/models``'s ``parent``."""
    pools: tuple[str, ...] = ()
    """The route's pools in tier order (for traces)."""
    overflow: PlanOverflow | None = None
    """The route's overflow to paid pools (``Route.overflow``); None without."""
    budget_blocks: tuple[PlanBudgetBlock, ...] = ()
    """Tenants past a budget, whose requests Envoy turns away (or diverts) first."""
    bound: int = 0
    """``capacityBound`` routes: the bounded load (a rung of the route's ladder) whose twin
    session requests take; 0 on other routes."""

    @property
    def short_name(self) -> str:
        """The route's name within its policy (``name`` is ``policy/route``)."""
        return self.name.rsplit("/", 1)[-1]


@dataclass(frozen=True, slots=True)
class PlanScorerService:
    """The operator's difficulty classifier, as Envoy calls it."""

    cluster: str
    host: str
    port: int
    path: str
    timeout: float
    """Seconds Envoy waits for the answer: the budget less the reserve for its own work."""
    fallback_large: bool
    """Requests it does not score in time go to the large model (else the small one)."""
    budget: float = 0.0
    """The policy's ``timeout``: what the whole scoring step may add to a request."""


@dataclass(frozen=True, slots=True)
class PlanStep:
    """A target of a virtual model between its first and its last (``large``)."""

    model: str
    threshold: float
    """Scores above it (and up to the next step's) go to this target."""
    tie: float
    """Probability that a score equal to ``threshold`` passes it."""


@dataclass(frozen=True, slots=True)
class PlanEscalation:
    """Retry a virtual model's small-model failures once on the large model."""

    cluster: str
    """The aggregate of the two targets' route clusters, small first."""
    members: tuple[str, str]
    protocol: Protocol
    retry_on: tuple[str, ...]
    """Envoy retry conditions."""
    per_try_timeout: float
    timeout: float
    idle_timeout: float
    large_hosts: tuple[str, ...] = ()
    """``address:port`` of the large model's endpoints: a try that lands on one of them
    carries the large model's name, whether it is the retry or the small model's pools were
    down from the start (then Envoy fails over to the large priorities at once)."""


@dataclass(frozen=True, slots=True)
class PlanVirtualModel:
    """A model name that Envoy answers with one of its target models, chosen per request:
    ``small``, the ``steps`` in order, ``large``."""

    key: str
    """``policy/name``: how Envoys report its scores and how its threshold is kept."""
    name: str
    small: str
    large: str
    scorer: str
    """builtin, external or header (``policies.models.Scorer.type``)."""
    weights: tuple[tuple[str, float], ...]
    bias: float
    header: str
    """Client header that states the difficulty."""
    threshold: float
    tie: float
    """Probability that a score equal to ``threshold`` takes the large model."""
    cap: float
    floor: float
    """Percent bounds of the large model's share, held by each Envoy worker."""
    service: PlanScorerService | None = None
    escalation: PlanEscalation | None = None
    steps: tuple[PlanStep, ...] = ()
    """Targets between ``small`` and ``large``, in order (none with two targets)."""


@dataclass(frozen=True, slots=True)
class PlanVirtualHost:
    """The routes of one RoutingPolicy on one listener."""

    name: str
    domains: tuple[str, ...]
    model_header: str
    routes: tuple[PlanRoute, ...]
    virtual_models: tuple[PlanVirtualModel, ...] = ()

    @property
    def routes_by_model(self) -> bool:
        """True when some route selects requests by model name."""
        return any(route.models for route in self.routes)

    @property
    def served_models(self) -> tuple[str, ...]:
        """Every model a route of this virtual host serves, virtual ones included, sorted."""
        return tuple(
            sorted(
                {model for route in self.routes for model in route.served_models}
                | {virtual.name for virtual in self.virtual_models}
            )
        )

    @property
    def adapters_listed(self) -> tuple[tuple[str, ...], Mapping[str, str]]:
        """What ``GET /v1/models`` lists: the served models, and adapter -> base model."""
        return self.served_models, {
            adapter: parent for route in self.routes for adapter, parent in route.adapters
        }


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
    upstream_signals: bool = False
    """Report every upstream attempt (pool host, status, time to first byte) to kvpilot over
    Envoy's gRPC access log service: some route here is under a Rollout that reads the
    data plane."""
    arrivals_log: bool = False
    """Report each upstream attempt's start and end to kvpilot (``xdsserver.arrivals``): a
    route here spills by its fleet's arrival rate (``FleetSpec.spill``), or overflows by its
    own (``Overflow.signal``)."""
    tracing: Tracing | None = None
    """The fleet's OpenTelemetry tracing, when it traces requests."""

    @property
    def tenant_headers(self) -> tuple[str, ...]:
        """The headers that name tenants on this listener's routes, sorted: traces tag them,
        token accounting logs them with every request."""
        return tuple(
            sorted({route.tenant_header for v in self.virtual_hosts for route in v.routes} - {""})
        )

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
    def virtual_models(self) -> bool:
        """True when some virtual host answers a virtual model (Envoy's Lua filter scores
        its requests and a log reports the scores to kvpilot)."""
        return any(vhost.virtual_models for vhost in self.virtual_hosts)

    @property
    def rate_limited(self) -> bool:
        """True when some route on the listener has a rate limit or a class budget."""
        return any(
            route.rate_limit is not None or any(c.budget for c in route.classes)
            for vhost in self.virtual_hosts
            for route in vhost.routes
        )

    @property
    def overflows(self) -> bool:
        """True when some route here sends overflow to paid pools."""
        return any(
            route.overflow is not None for vhost in self.virtual_hosts for route in vhost.routes
        )

    @property
    def classified(self) -> bool:
        """True when some route has service classes. The listener then always carries what
        shedding needs (the counting filter, the shed reply), whether or not anything is shed
        now, so that admission changes stay in RDS and never touch the listener."""
        return any(route.classes for vhost in self.virtual_hosts for route in vhost.routes)


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
    tracing: Tracing | None = None
    """Where this fleet's Envoys send spans, and how many requests they sample."""


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
    admission: Mapping[str, AdmissionDecision] = field(default_factory=dict, hash=False)
    """What telemetry decided for routes with service classes: route (``policy/route``) ->
    decision."""
    saturation: Mapping[str, SaturationDecision] = field(default_factory=dict, hash=False)
    """What telemetry decided for routes whose bounded load tightens under saturation:
    route (``policy/route``) -> decision."""
    difficulty: Mapping[str, ShareDecision] = field(default_factory=dict, hash=False)
    """Thresholds in force for virtual models with a share: ``policy/name`` -> decision."""
    spill: Mapping[str, SpillDecision] = field(default_factory=dict, hash=False)
    """What share of each located fleet's traffic its own locality keeps, per route cluster:
    ``fleet/policy/route`` -> decision (``compiler.locality``)."""
    gate_auto: Mapping[str, tuple[int, int]] = field(default_factory=dict, hash=False)
    """What set the gate of routes with ``overflow.maxInFlight: auto``: route
    (``policy/route``) -> (the first tier's batch slots, the Envoys in the policy's fleets)
    (``compiler.gate.auto_basis``)."""
    overflow: Mapping[str, OverflowDecision] = field(default_factory=dict, hash=False)
    """What telemetry decided for routes with paid overflow pools: route (``policy/route``)
    -> decision."""

    def fleet(self, name: str) -> FleetPlan | None:
        """The plan of fleet ``name``, or None."""
        for plan in self.fleets:
            if plan.fleet == name:
                return plan
        return None
