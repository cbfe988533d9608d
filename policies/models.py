"""The declarative objects users edit: Pool, RoutingPolicy, Fleet and Rollout.

Each object is a Kubernetes-like envelope (``apiVersion``, ``kind``, ``metadata.name``,
``spec``) read from YAML or JSON. Field names are camelCase on the wire and snake_case in
Python. Every field carries a description with its unit and default: these models are the API
reference (they also produce the OpenAPI schema of the REST API).
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

API_VERSION = "kvpilot.io/v1"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _parse_duration(value: Any) -> Any:
    """Accept ``"250ms"``, ``"5s"``, ``"2m"``, ``"1h"`` or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '5s' or '250ms'")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(
                f"{value!r} is not a duration: use a number of seconds or a string like "
                "'5s', '250ms', '2m'"
            )
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return value


def _format_duration(seconds: float) -> str:
    if seconds and seconds < 1:
        return f"{round(seconds * 1000)}ms"
    return f"{seconds:g}s"


Duration = Annotated[
    float,
    BeforeValidator(_parse_duration),
    Field(ge=0),
    PlainSerializer(_format_duration, return_type=str, when_used="json"),
]
"""Seconds in Python; ``"5s"``/``"250ms"`` strings or plain seconds on the wire."""

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$"
NAME_RULE = (
    "lowercase letters, digits, '-' and '.', at most 63 characters, "
    "starting and ending with a letter or digit"
)
Name = Annotated[
    str,
    Field(
        pattern=NAME_PATTERN,
        description=NAME_RULE[0].upper() + NAME_RULE[1:] + ".",
    ),
]
ENDPOINT_ID_PATTERN = r"^[A-Za-z0-9\[]([-A-Za-z0-9._:\[\]]{0,258}[A-Za-z0-9\]])?$"
"""A registered endpoint's id: a name, or ``address:port`` (``Endpoint.key``, what agents use)."""
ENDPOINT_ID_RULE = (
    "letters, digits, '-', '.', '_', ':', '[' and ']', at most 260 characters: "
    "a name, or address:port"
)
HeaderName = Annotated[str, Field(pattern=r"^[a-z0-9!#$%&'*+.^_`|~-]+$", max_length=128)]


class Model(BaseModel):
    """Base for every policy type: camelCase aliases, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


# --------------------------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------------------------


class Locality(Model):
    """Where an endpoint runs; Envoy uses it for zone-aware routing and in stats."""

    region: str = Field("", description="Region, for example 'us-east1'. Default: empty.")
    zone: str = Field("", description="Zone, for example 'us-east1-b'. Default: empty.")


EndpointHealth = Literal["healthy", "unhealthy", "draining", "degraded"]


class Endpoint(Model):
    """One model replica (or one provider address)."""

    address: str = Field(
        description="IP address or DNS name of the replica.", min_length=1, max_length=253
    )
    port: int = Field(description="TCP port of the replica's HTTP server.", ge=1, le=65535)
    weight: int = Field(
        100,
        ge=1,
        le=10_000,
        description="Relative load-balancing weight within its pool. Unitless, 1-10000. "
        "Default: 100. Round robin and least request follow it; telemetry may override it.",
    )
    locality: Locality | None = Field(None, description="Region and zone. Default: none.")
    health: EndpointHealth = Field(
        "healthy",
        description="Health as reported to Envoy over EDS. 'unhealthy' and 'draining' take the "
        "endpoint out of rotation; 'degraded' keeps it as a last resort. Default: healthy.",
    )
    name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="Stable name of the replica (a pod or host name). Session affinity places "
        "the replica on the hash ring by this name instead of its address, so a replica that "
        "comes back on a new address or port keeps its sessions. Unique within a pool. "
        "Default: none (placed by address:port).",
    )

    @functools.cached_property
    def key(self) -> str:
        """Stable identity of the endpoint within its pool: ``address:port``. Worked out once
        per parsed endpoint: validation, compile and telemetry weights all ask for it."""
        return f"{self.address}:{self.port}"


class HealthCheck(Model):
    """Active HTTP health checking by every Envoy."""

    enabled: bool = Field(True, description="Run active health checks. Default: true.")
    path: str = Field("/health", description="HTTP path to probe. Default: /health.")
    interval: Duration = Field(5.0, description="Time between probes. Default: 5s.")
    timeout: Duration = Field(1.0, description="Probe timeout. Default: 1s.")
    unhealthy_threshold: int = Field(
        2, ge=1, description="Failed probes before a host is marked unhealthy. Default: 2."
    )
    healthy_threshold: int = Field(
        1, ge=1, description="Passed probes before a host is marked healthy again. Default: 1."
    )


class OutlierDetection(Model):
    """Passive health: eject hosts that keep failing real requests.

    Envoy's own default ``max_ejection_percent`` is 10%, which among three hosts never ejects
    anything; kvpilot defaults to 100% and lets panic mode protect against ejecting everyone.
    """

    enabled: bool = Field(True, description="Eject failing hosts. Default: true.")
    consecutive_5xx: int = Field(
        5,
        alias="consecutive5xx",
        ge=1,
        description="Consecutive 5xx answers that eject a host. Default: 5.",
    )
    consecutive_gateway_failure: int = Field(
        3,
        ge=1,
        description="Consecutive 502/503/504 or connection failures that eject a host. Default: 3.",
    )
    interval: Duration = Field(2.0, description="Time between ejection sweeps. Default: 2s.")
    base_ejection_time: Duration = Field(
        10.0, description="Ejection time, multiplied by the number of ejections. Default: 10s."
    )
    max_ejection_percent: int = Field(
        100, ge=0, le=100, description="Most hosts that may be ejected, in percent. Default: 100."
    )


class CircuitBreakers(Model):
    """Per-Envoy limits towards the pool; requests above them fail fast with 503."""

    max_connections: int = Field(1024, ge=1, description="Connections. Default: 1024.")
    max_pending_requests: int = Field(
        1024, ge=1, description="Requests waiting for a connection. Default: 1024."
    )
    max_requests: int = Field(1024, ge=1, description="Requests in flight. Default: 1024.")
    max_retries: int = Field(16, ge=0, description="Retries in flight. Default: 16.")


class SecretRef(Model):
    """A reference to a secret; the value itself never passes through kvpilot.

    Each Envoy reads it from ``{secretsDir}/{name}.yaml`` on its own host (a Fleet setting;
    in Kubernetes, a mounted Secret), in Envoy's SDS file format: a ``resources`` list with one
    ``envoy.extensions.transport_sockets.tls.v3.Secret`` named ``name`` whose
    ``generic_secret.secret.inline_string`` is the whole header value, e.g. ``Bearer sk-...``.
    """

    name: Name = Field(description="Secret name; also its file name without '.yaml'.")


class TLS(Model):
    """TLS towards the upstream, for external providers."""

    sni: str | None = Field(
        None, description="Server name sent in the TLS handshake. Default: the endpoint address."
    )
    ca_file: str | None = Field(
        None,
        description="PEM file of trusted CAs on the Envoy host. Default: the fleet's "
        "trustedCaFile.",
    )
    insecure_skip_verify: bool = Field(
        False, description="Do not verify the server certificate (tests only). Default: false."
    )


class AuthHeader(Model):
    """A header that Envoy adds to every request to the pool, taken from a secret (Envoy's
    credential injector). Clients' own values of that header are replaced."""

    header: HeaderName = Field("authorization", description="Header name. Default: authorization.")
    secret_ref: SecretRef = Field(description="The secret holding the header's value.")


TelemetryFormat = Literal["vllm", "sglang", "tgi", "custom"]


TELEMETRY_MAX_AGE = 10.0
"""Seconds after which a telemetry record counts as unknown, unless a pool sets its own."""


class TelemetrySource(Model):
    """Where the pool's live load signal comes from."""

    format: TelemetryFormat = Field("vllm", description="Metric names to read. Default: vllm.")
    path: str = Field("/metrics", description="Prometheus endpoint path. Default: /metrics.")
    interval: Duration = Field(1.0, description="Scrape interval. Default: 1s.")
    max_age: Duration = Field(
        TELEMETRY_MAX_AGE,
        description="Telemetry older than this counts as unknown and gives a neutral weight. "
        "Default: 10s.",
    )


Protocol = Literal["http1", "http2"]


class PoolSpec(Model):
    """Replicas that serve the same model(s), or an external provider."""

    models: list[str] = Field(
        default_factory=list,
        description="Model names this pool serves (the OpenAI 'model' field). Default: none.",
    )
    protocol: Protocol = Field("http1", description="Upstream HTTP protocol. Default: http1.")
    endpoints: list[Endpoint] = Field(
        default_factory=list,
        description="Static endpoints. Endpoints registered through the API (or by agents) "
        "are added to these. Default: none.",
    )
    connect_timeout: Duration = Field(5.0, description="TCP connect timeout. Default: 5s.")
    health_check: HealthCheck = Field(
        default_factory=HealthCheck, description="Active health checks. Default: on, GET /health."
    )
    outlier_detection: OutlierDetection = Field(
        default_factory=OutlierDetection, description="Passive health. Default: on."
    )
    circuit_breakers: CircuitBreakers = Field(
        default_factory=CircuitBreakers, description="Circuit breaker thresholds."
    )
    tls: TLS | None = Field(None, description="TLS to the upstream. Default: plaintext.")
    host_rewrite: str | None = Field(
        None, description="Host header sent upstream (external providers). Default: unchanged."
    )
    auth: AuthHeader | None = Field(
        None, description="Credential header added by Envoy. Default: none."
    )
    telemetry: TelemetrySource | None = Field(
        None, description="Live load signal. Default: none (static weights)."
    )

    @field_validator("endpoints")
    @classmethod
    def _unique_endpoints(cls, endpoints: list[Endpoint]) -> list[Endpoint]:
        # (address, port) pairs are unique exactly when keys are (a port has no colon), and
        # are made without a cached property per endpoint: at 10,000 endpoints that was a
        # quarter of validating the pools.
        if len({(endpoint.address, endpoint.port) for endpoint in endpoints}) < len(endpoints):
            seen: set[str] = set()
            for endpoint in endpoints:
                if endpoint.key in seen:
                    raise ValueError(f"endpoint {endpoint.key} is listed twice")
                seen.add(endpoint.key)
        names = [endpoint.name for endpoint in endpoints if endpoint.name is not None]
        if len(set(names)) < len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(
                f"endpoint name {twice[0]!r} is used twice: two replicas with one name would "
                "share their place on the hash ring; give each its own"
            )
        return endpoints

    # --------------------------------------------------------------------------------------------
    # RoutingPolicy
    # --------------------------------------------------------------------------------------------

    @functools.cached_property
    def by_key(self) -> Mapping[str, Endpoint]:
        """The static endpoints by ``Endpoint.key``, in key order: what compile starts every
        route, count and weight of this pool from. Worked out once per parsed pool."""
        # Endpoint.key spelled out: the cached property costs more than the string on a
        # first access, and this is the first access for every static endpoint.
        keyed = {f"{endpoint.address}:{endpoint.port}": endpoint for endpoint in self.endpoints}
        return MappingProxyType({key: keyed[key] for key in sorted(keyed)})

    @functools.cached_property
    def external(self) -> bool:
        """An external provider: TLS, or endpoints named by DNS. It gets a cluster of its own
        that Envoy resolves, since EDS carries IP addresses only (Envoy rejects a name there:
        "malformed IP address"). Worked out once per parsed pool; every compile asks."""
        return self.tls is not None or any(not is_ip(e.address) for e in self.endpoints)


class HeaderMatch(Model):
    """Match a request header exactly."""

    name: HeaderName = Field(description="Header name, lowercase.")
    value: str = Field(description="Exact value.")


class RouteMatch(Model):
    """Which requests a route takes. All given conditions must hold."""

    models: list[str] = Field(
        default_factory=list,
        description="OpenAI model names, read from the JSON body's 'model' field or the "
        "model override header. Default: any model.",
    )
    path_prefix: str = Field("/", description="Request path prefix. Default: '/'.")
    headers: list[HeaderMatch] = Field(
        default_factory=list, description="Exact header matches. Default: none."
    )

    @field_validator("path_prefix")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("pathPrefix must start with '/'")
        return value


class PoolTarget(Model):
    """A pool within a tier and its share of the tier's traffic."""

    pool: Name = Field(description="Name of a Pool.")
    weight: int = Field(
        100,
        ge=0,
        le=10_000,
        description="Share of this tier's traffic, relative to the tier's other pools. "
        "0 drains the pool. Default: 100.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"pool": value} if isinstance(value, str) else value


class Tier(Model):
    """One failover tier: Envoy uses tier k+1 only when tier k lacks healthy capacity."""

    pools: list[PoolTarget] = Field(min_length=1, description="Pools in this tier.")
    fleet_weights: dict[Name, dict[Name, Annotated[int, Field(ge=0, le=10_000)]]] = Field(
        default_factory=dict,
        description="Pool weights this tier has in the named fleets instead of the pools' "
        "'weight' (fleet -> pool -> weight; a pool left out gets 0). A Rollout that takes "
        "fleets in order sets this while a step has reached only its canary fleets. "
        "Default: none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        return {"pools": value} if isinstance(value, list | str) else value

    @field_validator("pools", mode="before")
    @classmethod
    def _one_pool(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Tier:
        names = [target.pool for target in self.pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"pool {duplicates[0]!r} appears twice in one tier")
        if sum(target.weight for target in self.pools) == 0:
            raise ValueError("at least one pool in a tier needs a weight above 0")
        for fleet, weights in self.fleet_weights.items():
            unknown = sorted(set(weights) - set(names))
            if unknown:
                raise ValueError(
                    f"fleetWeights.{fleet} names pool {unknown[0]!r}, which is not in the tier"
                )
            if sum(weights.values()) == 0:
                raise ValueError(f"fleetWeights.{fleet} needs a pool with a weight above 0")
        return self

    def weights_in(self, fleet: str) -> Tier:
        """This tier as the Envoys of ``fleet`` get it (its ``fleetWeights`` applied)."""
        weights = self.fleet_weights.get(fleet)
        if weights is None:
            return self if not self.fleet_weights else self.model_copy(update={"fleet_weights": {}})
        pools = [
            target.model_copy(update={"weight": weights.get(target.pool, 0)})
            for target in self.pools
        ]
        return self.model_copy(update={"pools": pools, "fleet_weights": {}})


HashAlgorithm = Literal["ring_hash", "maglev"]


class SessionAffinity(Model):
    """Send a conversation's turns to the replica that holds its KV cache.

    Envoy hashes the session header onto a ring (or Maglev table) of the route's endpoints.
    Bounded load keeps any host under ``hashBalanceFactor``% of the average in-flight load, so a
    hot session spills over instead of creating a hotspot.
    """

    header: HeaderName = Field(
        "x-session-id", description="Header carrying the session ID. Default: x-session-id."
    )
    algorithm: HashAlgorithm = Field(
        "ring_hash", description="Consistent hash: ring_hash or maglev. Default: ring_hash."
    )
    hash_balance_factor: int = Field(
        150,
        ge=0,
        description="Bounded load, in percent of the average host load (100 = perfectly even, "
        "150 = no host above 1.5x average). 0 turns bounded load off. Default: 150.",
    )
    prefix_hash_chars: int = Field(
        0,
        ge=0,
        le=65536,
        description="When a request has no session header, hash the first N characters of its "
        "prompt instead, so requests sharing a long prefix meet the same cache. 0 turns it off. "
        "Default: 0.",
    )

    @field_validator("hash_balance_factor")
    @classmethod
    def _factor(cls, value: int) -> int:
        if 0 < value < 100:
            raise ValueError("hashBalanceFactor must be 0 (off) or at least 100 (percent)")
        return value


Balancing = Literal["round_robin", "least_request", "random", "telemetry", "orca"]
RetryOn = Literal["5xx", "reset", "connect-failure", "429", "gateway-error", "refused-stream"]
DEFAULT_RETRY_ON: tuple[RetryOn, ...] = ("5xx", "reset", "connect-failure", "429")


class Retries(Model):
    """Retries to other hosts, then to other tiers."""

    attempts: int = Field(2, ge=0, le=10, description="Retries after the first try. Default: 2.")
    retry_on: list[RetryOn] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_ON),
        description="Conditions that trigger a retry. Default: 5xx, reset, connect-failure, 429.",
    )
    per_try_timeout: Duration = Field(
        0.0, description="Time limit of each try; 0 = the route timeout. Default: 0."
    )
    backoff_base: Duration = Field(0.025, description="Base retry back-off. Default: 25ms.")


class Timeouts(Model):
    """Time limits that suit long and streaming (SSE) generations."""

    request: Duration = Field(
        600.0,
        description="Whole-request limit including the full streamed response; 0 = none. "
        "Default: 600s.",
    )
    idle: Duration = Field(
        120.0,
        description="Limit on silence within a stream (no bytes either way); 0 = none. "
        "Default: 120s.",
    )


RateUnit = Literal["second", "minute", "hour"]


class RateLimit(Model):
    """Token-bucket limit enforced by each Envoy (per worker-shared bucket)."""

    requests: int = Field(ge=1, description="Requests allowed per unit.")
    unit: RateUnit = Field("second", description="Time unit. Default: second.")
    burst: int | None = Field(None, ge=1, description="Bucket size. Default: equal to requests.")
    tenant_header: HeaderName | None = Field(
        None,
        description="Header naming the tenant; each distinct value gets its own bucket of the "
        "same size. Default: one bucket for the route.",
    )


# --------------------------------------------------------------------------------------------
# Service classes
# --------------------------------------------------------------------------------------------

ClassAction = Literal["admit", "shed", "queue", "divert"]


class ClassMatch(Model):
    """Which requests belong to a class. All given conditions must hold."""

    headers: list[HeaderMatch] = Field(
        default_factory=list,
        description="Exact header matches, for example x-priority: batch. Default: none.",
    )
    tenants: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list,
        description="Values of the tenant header (serviceClasses.tenantHeader) whose requests "
        "belong to this class. Default: any tenant.",
    )

    @model_validator(mode="after")
    def _not_empty(self) -> ClassMatch:
        if not self.headers and not self.tenants:
            raise ValueError("a class match needs headers or tenants; leave match out instead")
        return self


class ClassObjective(Model):
    """What the class is promised while the fleet has room."""

    ttft: Duration = Field(
        description="Time-to-first-token target (time to first byte for non-streaming "
        "requests), for example '1s' for interactive chat or '60s' for batch. Requests that "
        "meet it count as goodput."
    )


class ClassBudget(Model):
    """A token bucket for the whole class on each Envoy, shared fairly among its tenants."""

    requests: int = Field(ge=1, description="Requests the class may send per unit.")
    unit: Literal["second", "minute", "hour"] = Field(
        "second", description="Time unit. Default: second."
    )
    burst: int | None = Field(None, ge=1, description="Bucket size. Default: equal to requests.")
    tenant_share: int = Field(
        100,
        ge=1,
        le=100,
        description="Largest share of the class budget one tenant (a value of the tenant "
        "header) may take, in percent. Each tenant gets a bucket of this share of the budget; "
        "a request spends from its tenant's bucket and from the class bucket. Default: 100.",
    )


class ClassQueue(Model):
    """Where a queued class waits: in each Envoy, at most ``concurrency`` of its requests at
    the pool at once and ``size`` more waiting for one of those places (Envoy's circuit
    breakers on a cluster of the class's own); past that Envoy answers 503 at once."""

    concurrency: int = Field(
        8,
        ge=1,
        le=100_000,
        description="Requests of the class in flight to the pool at once, per Envoy: a "
        "connection limit, since with http1 each request holds a connection of its own. Envoy "
        "lets each worker thread open one connection past the limit, so the bound is at "
        "least the number of workers. Default: 8.",
    )
    size: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="Requests that wait in each Envoy for a place; more overflow with 503. "
        "Default: 1000.",
    )


class ServiceClass(Model):
    """A class of traffic with an objective and what to do when the fleet cannot meet it.

    While the route's pool is saturated (``serviceClasses.saturation``), kvpilot restricts the
    lowest classes first, in steps, and gives them back in the reverse order once the pool
    has recovered; classes whose action is ``admit`` are never restricted.
    """

    name: Name = Field(description="Class name, unique within the policy.")
    match: ClassMatch | None = Field(
        None,
        description="Which requests belong to the class. Classes are tried in order; a "
        "request that matches none takes its route's serviceClass (or defaultClass). "
        "Default: none (only routes and defaultClass name the class).",
    )
    objective: ClassObjective = Field(description="Time-to-first-token target.")
    when_saturated: ClassAction = Field(
        "admit",
        description="What Envoy does with the class's requests while the pool is saturated: "
        "admit (keep serving, queueing at the replicas), shed (answer 429 with Retry-After, "
        "in OpenAI's error format), queue (hold them in Envoy, see queue) or divert (send "
        "them to the route named by divertTo, for example a lower tier or an external "
        "provider). Default: admit.",
    )
    retry_after: Duration = Field(
        10.0,
        description="Retry-After sent with shed requests, rounded up to whole seconds. "
        "Default: 10s.",
    )
    divert_to: Name | None = Field(
        None,
        description="Route of this policy that takes diverted requests (whenSaturated: "
        "divert). Default: none.",
    )
    queue: ClassQueue | None = Field(
        None,
        description="Bounds of the queue in Envoy (whenSaturated: queue). Default: "
        "concurrency 8, size 1000.",
    )
    budget: ClassBudget | None = Field(
        None, description="Request budget of the class, fair among tenants. Default: none."
    )

    @model_validator(mode="after")
    def _check(self) -> ServiceClass:
        if self.queue is not None and self.when_saturated != "queue":
            raise ValueError("queue applies only with whenSaturated 'queue'")
        if self.when_saturated == "divert" and self.divert_to is None:
            raise ValueError("whenSaturated 'divert' needs divertTo: the route that takes them")
        if self.divert_to is not None and self.when_saturated != "divert":
            raise ValueError("divertTo applies only with whenSaturated 'divert'")
        return self


TTFT_SHARE = 0.5
"""Share of the most important class's TTFT objective that the pool's mean time to first
token may reach before the pool counts as saturated (``Saturation.ttft``'s default)."""


class Saturation(Model):
    """When a pool counts as saturated, from its live telemetry (``Pool.spec.telemetry``).

    Pressure is the largest of the pool's mean time to first token, queue, KV-cache use and
    pending tokens, each divided by its bound here: 1.0 means saturated. The time to first
    token is what the objectives promise, and long prompts prefilling beside short ones slow
    it well before any queue forms, so its bound follows the most important class's
    objective. kvpilot sheds (or diverts) one more step of the lowest restricted class while
    pressure is at or above ``high`` and not falling, and gives one step back while it is at
    or below ``low``: between the two nothing moves.
    """

    ttft: Duration | None = Field(
        None,
        gt=0,
        description="Mean time to first token on the pool's replicas (as the engines report "
        "it, all classes together) at which the pool is saturated. Default: half the "
        "objective of the most important class: the slowest of its requests cross the "
        "objective about when the mean crosses half of it.",
    )
    queue: float = Field(
        4.0,
        gt=0,
        description="Mean requests waiting per replica at which the pool is saturated. Default: 4.",
    )
    kv_cache: float = Field(
        0.95, gt=0, le=1, description="Mean KV-cache use that saturates the pool. Default: 0.95."
    )
    pending_tokens: float | None = Field(
        None,
        gt=0,
        description="Mean tokens admitted but not yet processed per replica that saturate the "
        "pool. Default: not used.",
    )
    high: float = Field(
        1.0, gt=0, description="Pressure at which the next step is shed. Default: 1.0."
    )
    low: float = Field(
        0.5, ge=0, description="Pressure at or below which a step is given back. Default: 0.5."
    )
    step: int = Field(
        25,
        ge=1,
        le=100,
        description="Share of a class's requests restricted or given back at a time, in "
        "percent. Default: 25.",
    )
    shed_interval: Duration = Field(
        1.0, description="Least time between two steps of shedding. Default: 1s."
    )
    recover_interval: Duration = Field(
        3.0,
        description="Least time between a change and a step given back; longer than "
        "shedInterval so a recovering pool does not flap. Default: 3s.",
    )

    @model_validator(mode="after")
    def _band(self) -> Saturation:
        if self.low >= self.high:
            raise ValueError("saturation low must be below high (the hysteresis band)")
        return self


class ServiceClasses(Model):
    """Classes of service of a policy's routes, most important first."""

    classes: list[ServiceClass] = Field(
        min_length=1, max_length=8, description="The classes, most important first."
    )
    default_class: Name | None = Field(
        None,
        description="Class of requests that no class matches and whose route names none. "
        "Default: the first class.",
    )
    tenant_header: HeaderName = Field(
        "x-tenant-id",
        description="Header naming the tenant, for class matches by tenant and for tenant "
        "shares of a class budget. Default: x-tenant-id.",
    )
    saturation: Saturation = Field(
        default_factory=Saturation, description="When the pool counts as saturated."
    )

    @property
    def ttft_bound(self) -> float:
        """The mean time to first token that saturates the pool: ``saturation.ttft``, else
        ``TTFT_SHARE`` of the most important class's objective."""
        if self.saturation.ttft is not None:
            return self.saturation.ttft
        return self.classes[0].objective.ttft * TTFT_SHARE

    def names(self) -> list[str]:
        """Class names, most important first."""
        return [service_class.name for service_class in self.classes]

    @property
    def queued(self) -> list[ServiceClass]:
        """The classes that wait in Envoy when restricted."""
        return [c for c in self.classes if c.when_saturated == "queue"]

    @property
    def default(self) -> str:
        """The class of requests that nothing else classifies."""
        return self.default_class or self.classes[0].name


class Route(Model):
    """A set of requests and where they go."""

    name: Name = Field(description="Route name, unique within the policy.")
    match: RouteMatch = Field(default_factory=RouteMatch, description="Which requests.")
    tiers: list[Tier] = Field(
        min_length=1,
        max_length=8,
        description="Ordered failover tiers; the first is preferred.",
    )
    balancing: Balancing = Field(
        "least_request",
        description="How Envoy picks a host when no session affinity applies: round_robin, "
        "least_request, random, telemetry (weights from live load) or orca (Envoy weighs "
        "hosts by the load they report per response). Default: least_request.",
    )
    session_affinity: SessionAffinity | None = Field(
        None, description="Consistent hashing on a session header. Default: off."
    )
    retries: Retries = Field(default_factory=Retries, description="Retry policy.")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="Time limits.")
    rate_limit: RateLimit | None = Field(None, description="Rate limit. Default: none.")
    service_class: Name | None = Field(
        None,
        description="Class of this route's requests that no class's match claims (see "
        "serviceClasses). Default: the policy's defaultClass.",
    )

    @model_validator(mode="after")
    def _check(self) -> Route:
        seen: set[str] = set()
        for tier in self.tiers:
            for target in tier.pools:
                if target.pool in seen:
                    raise ValueError(f"pool {target.pool!r} appears in more than one tier")
                seen.add(target.pool)
        if self.session_affinity is not None and self.balancing == "orca":
            raise ValueError(
                "sessionAffinity and balancing 'orca' exclude each other: a cluster has one "
                "load-balancing policy"
            )
        return self


class ListenerSpec(Model):
    """Where Envoy accepts client traffic."""

    address: str = Field("0.0.0.0", description="Bind address. Default: 0.0.0.0.")
    port: int = Field(10000, ge=1, le=65535, description="Port. Default: 10000.")


class RoutingPolicySpec(Model):
    """How requests reaching a listener are routed to pools."""

    fleets: list[Name | Literal["*"]] = Field(
        default_factory=lambda: ["default"],
        description="Envoy fleets (node.cluster) that receive this policy; '*' for all. "
        "Default: [default].",
    )
    listener: ListenerSpec = Field(
        default_factory=ListenerSpec, description="Listener address and port."
    )
    hosts: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Host (authority) names this policy answers for. Default: ['*'].",
    )
    model_header: HeaderName = Field(
        "x-model",
        description="Header that overrides the body's 'model' field for routing. Default: x-model.",
    )
    routes: list[Route] = Field(min_length=1, description="Routes, first match wins.")
    service_classes: ServiceClasses | None = Field(
        None,
        description="Classes of service: which requests keep their latency and which are shed "
        "or diverted first when the pool is saturated. Default: none (one class, never shed).",
    )

    @model_validator(mode="after")
    def _check(self) -> RoutingPolicySpec:
        names = [route.name for route in self.routes]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"route name {name!r} is used twice")
        errors = self._class_errors(names)
        if errors:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError("value_error", message.replace("{", "{{")),
                        loc=location,
                        input=None,
                    )
                    for location, message in errors
                ],
            )
        return self

    def _class_errors(self, routes: list[str]) -> list[tuple[tuple[str | int, ...], str]]:
        """References between classes and routes, each with the path of the field at fault."""
        errors: list[tuple[tuple[str | int, ...], str]] = []
        classes = self.service_classes
        declared = classes.names() if classes is not None else []
        for index, route in enumerate(self.routes):
            if route.service_class is not None and route.service_class not in declared:
                errors.append(
                    (
                        ("routes", index, "serviceClass"),
                        f"class {route.service_class!r} is not declared in serviceClasses"
                        + (f" (declared: {', '.join(declared)})" if declared else ""),
                    )
                )
        if classes is None:
            return errors
        where: tuple[str | int, ...] = ("serviceClasses",)
        for index, name in enumerate(declared):
            if declared.index(name) != index:
                errors.append(
                    ((*where, "classes", index, "name"), f"class {name!r} is declared twice")
                )
        if classes.default_class is not None and classes.default_class not in declared:
            errors.append(
                (
                    (*where, "defaultClass"),
                    f"class {classes.default_class!r} is not declared; declared: "
                    + ", ".join(declared),
                )
            )
        for index, service_class in enumerate(classes.classes):
            if service_class.divert_to is not None and service_class.divert_to not in routes:
                errors.append(
                    (
                        (*where, "classes", index, "divertTo"),
                        f"route {service_class.divert_to!r} is not a route of this policy; "
                        f"routes: {', '.join(routes)}",
                    )
                )
        return errors


# --------------------------------------------------------------------------------------------
# Fleet
# --------------------------------------------------------------------------------------------


class FleetSpec(Model):
    """Settings for one fleet of Envoys (the Envoys whose node.cluster is this name)."""

    max_request_body_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="Largest request body Envoy buffers to read the model name, in bytes. "
        "Long prompts are the norm. Default: 33554432 (32 MiB).",
    )
    access_log: bool = Field(True, description="Write an access log to stdout. Default: true.")
    drain_timeout: Duration = Field(
        30.0, description="How long in-flight requests may finish on shutdown. Default: 30s."
    )
    secrets_dir: str = Field(
        "/etc/envoy/secrets",
        description="Directory on each Envoy host holding the secret files that pools' auth "
        "headers name ({secretsDir}/{name}.yaml). Default: /etc/envoy/secrets.",
    )
    trusted_ca_file: str = Field(
        "/etc/ssl/certs/ca-certificates.crt",
        description="PEM bundle of CAs on each Envoy host that TLS pools trust unless they name "
        "their own caFile. Default: /etc/ssl/certs/ca-certificates.crt.",
    )


# --------------------------------------------------------------------------------------------
# Rollout
# --------------------------------------------------------------------------------------------


class RolloutTarget(Model):
    """The route tier whose pool weights a rollout changes."""

    policy: Name = Field(description="Name of the RoutingPolicy.")
    route: Name = Field(description="Name of the route within that policy.")
    tier: int = Field(
        0, ge=0, le=7, description="Index of the failover tier whose split changes. Default: 0."
    )


class RolloutStep(Model):
    """One step of weight, held until its minimum duration and requests have passed and the
    analysis found nothing wrong."""

    weight: int | None = Field(
        None,
        ge=0,
        le=100,
        description="The canary pool's share of the tier, in percent; the stable pool gets the "
        "rest. Give this or 'weights'.",
    )
    weights: dict[Name, Annotated[int, Field(ge=0, le=100)]] | None = Field(
        None,
        description="Every pool's share of the tier at this step, in percent, adding up to "
        "100 (a set of pool weights moving to another). Give this or 'weight'.",
    )
    min_duration: Duration = Field(
        60.0, description="Least time the step is held before the next one. Default: 60s."
    )
    min_requests: int = Field(
        0,
        ge=0,
        description="Least requests the canary must have answered during the step before the "
        "next one. Default: 0.",
    )


RolloutMetric = Literal["errorRate", "ttfb", "latency"]
"""``errorRate``: 5xx answers over requests; ``ttfb``: time from the request reaching the
replica to its first response byte (time to first token for a streamed completion);
``latency``: time to the last response byte."""


class AnalysisRule(Model):
    """A check on the canary's live numbers during every step."""

    name: str = Field(
        "", max_length=63, description="Label shown in status. Default: the metric's name."
    )
    metric: RolloutMetric | None = Field(
        None,
        description="A data-plane metric measured by the Envoys themselves, per pool: "
        "errorRate (5xx answers / requests, 0-1), ttfb (time to first byte, seconds) or "
        "latency (time to last byte, seconds). Give this or 'query'.",
    )
    percentile: float = Field(
        95.0, gt=0, lt=100, description="Percentile of ttfb or latency. Default: 95."
    )
    max: float | None = Field(
        None,
        ge=0,
        description="Fail when the canary's value (or the query's) is above this: a fraction "
        "for errorRate, seconds for ttfb and latency.",
    )
    max_ratio: float | None = Field(
        None,
        gt=0,
        description="Fail when the canary's value is above this multiple of the stable "
        "pool's, measured over the same step (for errorRate: above the stable rate times this, "
        "plus 1 percentage point).",
    )
    query: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A PromQL query against analysis.prometheus instead of a data-plane "
        "metric; its value is compared with 'max'. '{canary}', '{stable}', '{route}' and "
        "'{interval}' (the step's age, e.g. '30s') are filled in.",
    )

    @property
    def label(self) -> str:
        """The rule's name in status and history."""
        if self.name:
            return self.name
        if self.metric in ("ttfb", "latency"):
            return f"{self.metric} p{self.percentile:g}"
        return self.metric or "query"


class PrometheusSource(Model):
    """A Prometheus server that query rules read."""

    url: str = Field(pattern=r"^https?://", description="Base URL, e.g. http://prometheus:9090.")
    timeout: Duration = Field(5.0, description="Query timeout. Default: 5s.")


def _default_rules() -> list[AnalysisRule]:
    return [AnalysisRule(metric="errorRate", max=0.05)]


class Analysis(Model):
    """How each step's verdict is reached."""

    min_sample: int = Field(
        50,
        ge=1,
        description="Requests the canary (and, for relative rules, the stable pool) must have "
        "answered during the step before any verdict. Default: 50.",
    )
    interval: Duration = Field(1.0, description="How often the rules are evaluated. Default: 1s.")
    rules: list[AnalysisRule] = Field(
        default_factory=_default_rules,
        description="Checks that must all pass. Default: errorRate at most 5%.",
    )
    prometheus: PrometheusSource | None = Field(
        None, description="Prometheus server for query rules. Default: none."
    )


FailureAction = Literal["rollback", "pause"]


class RolloutSpec(Model):
    """Move a route tier's weight between pools step by step, watching the data plane."""

    target: RolloutTarget = Field(description="Which route tier.")
    stable: Name | None = Field(
        None, description="The pool weight moves away from (steps with 'weight')."
    )
    canary: Name | None = Field(None, description="The pool weight moves to (steps with 'weight').")
    steps: list[RolloutStep] = Field(
        min_length=1, max_length=100, description="Steps in order; the last is the end state."
    )
    fleets: list[Name] = Field(
        default_factory=list,
        description="Canary fleets, which take every step first: their Envoys get a step's "
        "weights while every other fleet keeps the weights of the step before, until the "
        "step has been held and has passed its analysis on the canary fleets' traffic alone; "
        "then the step reaches every fleet and is held and analysed again. Default: none "
        "(every fleet at once).",
    )
    analysis: Analysis = Field(
        default_factory=Analysis, description="Checks applied at every step."
    )
    on_failure: FailureAction = Field(
        "rollback",
        description="What a failed check does: rollback (back to the weights the rollout "
        "started from) or pause (hold the current step for a person). Default: rollback.",
    )

    def problems(self) -> list[tuple[str, str]]:
        """Consistency problems between fields, each as (path under spec, sentence)."""
        out: list[tuple[str, str]] = []
        uses_weight = False
        previous: int | None = None
        for index, step in enumerate(self.steps):
            path = f"steps[{index}]"
            if (step.weight is None) == (step.weights is None):
                out.append((path, "give either 'weight' (the canary's percent) or 'weights'"))
                continue
            if step.weight is not None:
                uses_weight = True
                if previous is not None and step.weight <= previous:
                    out.append(
                        (
                            f"{path}.weight",
                            f"steps must raise the canary's weight: {step.weight} does not "
                            f"come after {previous}",
                        )
                    )
                previous = step.weight
            elif step.weights is not None and sum(step.weights.values()) != 100:
                out.append(
                    (
                        f"{path}.weights",
                        f"the weights add up to {sum(step.weights.values())}, not 100",
                    )
                )
        duplicates = sorted({f for f in self.fleets if self.fleets.count(f) > 1})
        if duplicates:
            out.append(("fleets", f"fleet {duplicates[0]!r} is named twice"))
        if uses_weight:
            for field_name in ("stable", "canary"):
                if getattr(self, field_name) is None:
                    out.append((field_name, "steps with 'weight' need a stable and a canary pool"))
            if self.stable is not None and self.stable == self.canary:
                out.append(("canary", "the canary pool must differ from the stable pool"))
        for index, rule in enumerate(self.analysis.rules):
            path = f"analysis.rules[{index}]"
            if (rule.metric is None) == (rule.query is None):
                out.append((path, "give either 'metric' or 'query'"))
            elif rule.query is not None:
                if rule.max is None:
                    out.append((f"{path}.max", "a query rule needs 'max'"))
                if rule.max_ratio is not None:
                    out.append((f"{path}.maxRatio", "a query rule compares with 'max' only"))
                if self.analysis.prometheus is None:
                    out.append((f"{path}.query", "a query rule needs analysis.prometheus.url"))
            elif rule.max is None and rule.max_ratio is None:
                out.append((path, "give 'max', 'maxRatio' or both"))
        return out

    def step_weights(self, index: int) -> dict[str, int]:
        """Every pool's weight (percent) at step ``index``."""
        step = self.steps[index]
        if step.weights is not None:
            return dict(step.weights)
        assert step.weight is not None and self.stable and self.canary
        return {self.stable: 100 - step.weight, self.canary: step.weight}

    def pools(self) -> list[str]:
        """Every pool the rollout moves weight between, in first-mention order."""
        names: dict[str, None] = {}
        for field_name in (self.stable, self.canary):
            if field_name:
                names[field_name] = None
        for step in self.steps:
            names.update(dict.fromkeys(step.weights or {}))
        return list(names)


# --------------------------------------------------------------------------------------------
# Envelope
# --------------------------------------------------------------------------------------------


class Metadata(Model):
    """Object identity."""

    name: Name = Field(description="Object name, unique per kind.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels.")


class _Object(Model):
    api_version: Literal["kvpilot.io/v1"] = Field(
        "kvpilot.io/v1", description="Always kvpilot.io/v1."
    )
    metadata: Metadata


class Pool(_Object):
    """Replicas serving one model, or an external provider."""

    kind: Literal["Pool"] = "Pool"
    spec: PoolSpec


class RoutingPolicy(_Object):
    """Routes from a listener to pools."""

    kind: Literal["RoutingPolicy"] = "RoutingPolicy"
    spec: RoutingPolicySpec


class Fleet(_Object):
    """Per-fleet listener settings."""

    kind: Literal["Fleet"] = "Fleet"
    spec: FleetSpec = Field(default_factory=FleetSpec)


class Rollout(_Object):
    """A progressive weight change with automatic analysis and rollback."""

    kind: Literal["Rollout"] = "Rollout"
    spec: RolloutSpec


PolicyObject = Pool | RoutingPolicy | Fleet | Rollout
KINDS: dict[str, type[PolicyObject]] = {
    "Pool": Pool,
    "RoutingPolicy": RoutingPolicy,
    "Fleet": Fleet,
    "Rollout": Rollout,
}

KIND_PATHS: dict[str, str] = {
    "Pool": "pools",
    "RoutingPolicy": "routingpolicies",
    "Fleet": "fleets",
    "Rollout": "rollouts",
}
"""Each kind's plural: its REST path segment (``/v1/pools``) and its etcd key segment."""

PATH_KINDS: dict[str, str] = {path: kind for kind, path in KIND_PATHS.items()}
"""The inverse of ``KIND_PATHS``: a plural (``pools``) -> its kind (``Pool``)."""

_KIND_ALIASES = {
    **{kind.lower(): kind for kind in KIND_PATHS},
    **PATH_KINDS,
    "policy": "RoutingPolicy",
    "policies": "RoutingPolicy",
    "rp": "RoutingPolicy",
}


def kind_named(text: str) -> str | None:
    """The kind a user means: ``Pool``, ``pool`` or ``pools`` -> ``Pool``; also ``rp`` and
    ``policy`` for RoutingPolicy. None when `text` names no kind."""
    return text if text in KIND_PATHS else _KIND_ALIASES.get(text.lower())


_IPV4 = re.compile(
    r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
)
"""The dotted quads `ipaddress` accepts (no leading zeros): a pool of 10,000 endpoints is
checked in a few milliseconds instead of a few hundred."""


def is_ip(address: str) -> bool:
    """True for an IPv4 or IPv6 address, False for a DNS name."""
    if _IPV4.fullmatch(address):
        return True
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True
