"""A Pool's spec: its endpoints, health checks, outlier detection, circuit breakers, TLS,
auth header and telemetry source."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from pydantic import Field, field_validator, model_validator

from policies.models.fields import Capacity, Duration, HeaderName, Model, Name, is_ip
from policies.models.price import Price


class Locality(Model):
    """Where an endpoint (or a fleet of Envoys) runs. A fleet with a locality sends to its own
    zone first, then its own region, then other regions (``docs/regions.md``); Envoy also
    shows it in stats."""

    region: str = Field(
        "",
        max_length=128,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9._]*[A-Za-z0-9])?$|^$",
        description="Region, for example 'us-east1'. Default: empty.",
    )
    zone: str = Field(
        "",
        max_length=128,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9._]*[A-Za-z0-9])?$|^$",
        description="Zone within the region, for example 'us-east1-b'. Needs a region. "
        "Default: empty.",
    )

    @model_validator(mode="after")
    def _zone_needs_region(self) -> Locality:
        if self.zone and not self.region:
            # A zone name is only unique within its region: without one, two regions' zones
            # of the same name would count as the same place.
            raise ValueError(
                f"zone {self.zone!r} has no region: set region too (a zone is a part of a region)"
            )
        return self


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
    locality: Locality | None = Field(
        None,
        description="Region and zone. Fleets with a locality of their own send to their own "
        "zone, then region, then the others. Default: none.",
    )
    capacity: Capacity | None = Field(
        None,
        description="How the replica's machine is bought: 'on-demand', 'spot' or 'reserved'. "
        "Pools with preferCapacity send to the preferred kind first. Default: none (unknown).",
    )
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
    price: Price | None = Field(
        None,
        description="What the pool costs, per token or per replica-hour (docs/cost.md). "
        "Default: none (tokens are counted, not priced).",
    )
    prefer_capacity: list[Capacity] = Field(
        default_factory=list,
        max_length=3,
        description="Capacity kinds in order of preference, for example ['spot', 'on-demand']: "
        "within each locality, endpoints of the first kind are tried first and the others "
        "take what they cannot serve (health, saturation). Endpoints of an unlisted or "
        "unknown kind come last. Where price.byCapacity prices the listed kinds, they are "
        "tried cheapest first (this order breaks ties and places unpriced kinds). "
        "Default: none (all alike).",
    )

    def capacity_order(self) -> list[Capacity]:
        """The kinds in the order their endpoints are tried: ``prefer_capacity``, sorted by
        replica-hour price where ``price.by_capacity`` prices a kind (the stated order
        breaking ties), kinds without a price of their own after the priced ones, in the
        stated order."""
        by_kind = self.price.by_capacity if self.price is not None else {}
        if not by_kind:
            return list(self.prefer_capacity)
        stated = {kind: index for index, kind in enumerate(self.prefer_capacity)}
        return sorted(
            self.prefer_capacity,
            key=lambda kind: (kind not in by_kind, by_kind.get(kind, 0), stated[kind]),
        )

    @field_validator("prefer_capacity")
    @classmethod
    def _unique_capacities(cls, kinds: list[Capacity]) -> list[Capacity]:
        if len(set(kinds)) < len(kinds):
            raise ValueError(f"capacity kinds {kinds} list one kind twice")
        return kinds

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
