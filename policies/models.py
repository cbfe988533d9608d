"""The declarative objects users edit: Pool, RoutingPolicy and Fleet.

Each object is a Kubernetes-like envelope (``apiVersion``, ``kind``, ``metadata.name``,
``spec``) read from YAML or JSON. Field names are camelCase on the wire and snake_case in
Python. Every field carries a description with its unit and default: these models are the API
reference (they also produce the OpenAPI schema of the REST API).
"""

from __future__ import annotations

import functools
import ipaddress
import re
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
Name = Annotated[
    str,
    Field(
        pattern=NAME_PATTERN,
        description="Lowercase letters, digits, '-' and '.', at most 63 characters, "
        "starting and ending with a letter or digit.",
    ),
]
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
        seen: set[str] = set()
        for endpoint in endpoints:
            if endpoint.key in seen:
                raise ValueError(f"endpoint {endpoint.key} is listed twice")
            seen.add(endpoint.key)
        return endpoints

    # --------------------------------------------------------------------------------------------
    # RoutingPolicy
    # --------------------------------------------------------------------------------------------

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
        return self


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

    @model_validator(mode="after")
    def _check(self) -> RoutingPolicySpec:
        names = [route.name for route in self.routes]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"route name {name!r} is used twice")
        return self


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


PolicyObject = Pool | RoutingPolicy | Fleet
KINDS: dict[str, type[PolicyObject]] = {
    "Pool": Pool,
    "RoutingPolicy": RoutingPolicy,
    "Fleet": Fleet,
}

KIND_PATHS: dict[str, str] = {
    "Pool": "pools",
    "RoutingPolicy": "routingpolicies",
    "Fleet": "fleets",
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
