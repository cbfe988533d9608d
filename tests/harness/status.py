"""What a running kvpilot says about itself and its Envoys: `/v1/status`, the versions it
serves per fleet, and samples of its `/metrics`."""

from __future__ import annotations

import re
from typing import Any

import httpx

from controlplane.local import EmbeddedEnvoy

TYPES = {"CDS": "clusters", "EDS": "endpoints", "LDS": "listeners", "RDS": "routes"}
"""Short type name in /v1/status -> key of the versions in /v1/fleets/{fleet}/config."""


def envoys(api: httpx.Client) -> list[dict[str, Any]]:
    """The Envoys connected to kvpilot, as `/v1/status` lists them."""
    response = api.get("/v1/status")
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()["envoys"]
    return result


def envoy_types(api: httpx.Client, node_id: str) -> dict[str, dict[str, Any]]:
    """Per short type name, the status kvpilot reports for one Envoy (empty if not connected)."""
    for connection in envoys(api):
        if connection["node_id"] == node_id:
            return {t["type"]: t for t in connection["types"].values()}
    return {}


def served_versions(api: httpx.Client, fleet: str) -> dict[str, str]:
    """Per short type name, the version kvpilot serves to `fleet`."""
    response = api.get(f"/v1/fleets/{fleet}/config")
    response.raise_for_status()
    versions = response.json()["versions"]
    return {short: versions[key] for short, key in TYPES.items()}


def acked_everything(api: httpx.Client, envoy: EmbeddedEnvoy) -> dict[str, str] | None:
    """The served versions once the Envoy has ACKed every type at exactly those, else None."""
    served = served_versions(api, envoy.fleet)
    types = envoy_types(api, envoy.node_id)
    acked = {short: types[short]["version_acked"] for short in TYPES if short in types}
    return served if acked == served else None


def metric(api_url: str, name: str, **labels: str) -> float:
    """The sample of `name` in kvpilot's /metrics whose labels are exactly `labels` (0 when
    absent)."""
    text = httpx.get(f"{api_url}/metrics", timeout=10).text
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if match is None or match.group(1) != name:
            continue
        if dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")) == labels:
            return float(match.group(3))
    return 0.0
