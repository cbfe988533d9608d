"""A Fleet's spec: listener settings shared by the Envoys of one fleet (``node.cluster``)."""

from __future__ import annotations

from pydantic import Field

from policies.models.fields import Duration, Model
from policies.models.pool import Locality


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
