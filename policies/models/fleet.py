"""A Fleet's spec: listener settings shared by the Envoys of one fleet (``node.cluster``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from policies.models.fields import Duration, Model
from policies.models.pool import Locality


class Tracing(Model):
    """Envoy's OpenTelemetry tracer for this fleet's listeners: a span per sampled request,
    exported over OTLP/gRPC to a collector. A client's W3C ``traceparent`` is continued and
    passed on to the replica."""

    collector: str = Field(
        description="host:port of the OpenTelemetry collector's OTLP/gRPC receiver, as each "
        "Envoy of the fleet reaches it (an IP address or a DNS name).",
        min_length=3,
        max_length=261,
        pattern=r"^[A-Za-z0-9_.\-]+:[0-9]{1,5}$",
    )
    sampling: float = Field(
        1.0,
        ge=0,
        le=100,
        description="Percent of requests traced (Envoy's random sampling). Default: 1.",
    )
    service_name: str = Field(
        "kvpilot-envoy",
        min_length=1,
        max_length=128,
        description="service.name of the spans. Default: kvpilot-envoy.",
    )

    @field_validator("collector")
    @classmethod
    def _port(cls, value: str) -> str:
        if not 1 <= int(value.rsplit(":", 1)[1]) <= 65535:
            raise ValueError("the collector's port must be 1-65535")
        return value

    @property
    def host(self) -> str:
        """The collector's host."""
        return self.collector.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        """The collector's port."""
        return int(self.collector.rsplit(":", 1)[1])


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
    tracing: Tracing | None = Field(
        None, description="OpenTelemetry tracing of this fleet's requests. Default: off."
    )
    trusted_ca_file: str = Field(
        "/etc/ssl/certs/ca-certificates.crt",
        description="PEM bundle of CAs on each Envoy host that TLS pools trust unless they name "
        "their own caFile. Default: /etc/ssl/certs/ca-certificates.crt.",
    )
    locality: Locality | None = Field(
        None,
        description="Where this fleet's Envoys run. With a locality, each route's replicas "
        "are ordered for this fleet: its own zone, then its own region, then other regions "
        "(EDS priorities), and a locality spills to the next only what it cannot serve "
        "(unhealthy or saturated replicas). Without one, every locality is alike "
        "(locality-blind). Default: none.",
    )
    node_locality: bool = Field(
        False,
        description="This fleet's Envoys say where they run in their node.locality (bootstrap "
        "node.locality.region and .zone): kvpilot computes a view for each region and zone "
        "that has replicas, and serves each Envoy the view of its place (zone, else region); "
        "an Envoy without a node locality, or in a place without replicas, gets the fleet's "
        "own view (at locality, if set). Default: false.",
    )
    spill_signal: Literal["arrivals", "fill"] = Field(
        "arrivals",
        description="What a located fleet's spill follows. arrivals: its Envoys report each "
        "request's start to kvpilot (the router's upstream log), and its locality keeps what "
        "its capacity serves of the fleet's arrival rate, at once, corrected by the replicas' "
        "batch fill; fill: the batch fill alone, without the extra log (a cut is seen only as "
        "the requests admitted before it finish). Default: arrivals.",
    )
