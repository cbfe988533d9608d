"""What a real Envoy says it holds, read from its admin interface: the hosts of a cluster with
their health and weight, and the listeners it serves."""

from __future__ import annotations

import collections

from compiler.compile import listener_name
from controlplane.local import EmbeddedEnvoy


def envoy_hosts(envoy: EmbeddedEnvoy, cluster: str) -> dict[int, dict[str, str]]:
    """Port -> field -> value of the hosts of `cluster`, from Envoy's admin `/clusters`."""
    hosts: dict[int, dict[str, str]] = collections.defaultdict(dict)
    for line in envoy.clusters().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and ":" in parts[1]:
            hosts[int(parts[1].rsplit(":", 1)[1])][parts[2]] = parts[3]
    return dict(hosts)


def endpoint_weights(envoy: EmbeddedEnvoy, cluster: str) -> dict[int, int]:
    """Port -> weight of the endpoints Envoy has for `cluster`."""
    return {
        port: int(host["weight"])
        for port, host in envoy_hosts(envoy, cluster).items()
        if "weight" in host
    }


def health_flags(envoy: EmbeddedEnvoy, cluster: str) -> dict[int, str]:
    """Port -> Envoy's health flags for the hosts of `cluster`."""
    return {
        port: host["health_flags"]
        for port, host in envoy_hosts(envoy, cluster).items()
        if "health_flags" in host
    }


def active_listeners(envoy: EmbeddedEnvoy) -> set[str]:
    """Names of the dynamic listeners Envoy serves (those that finished warming)."""
    return {
        listener["name"]
        for config in envoy.config_dump()["configs"]
        for listener in config.get("dynamic_listeners", [])
        if "active_state" in listener
    }


def serves_listener(envoy: EmbeddedEnvoy, port: int) -> bool:
    """Whether Envoy serves the policy listener on `port`: it goes active once its routes
    arrived."""
    return listener_name(port) in active_listeners(envoy)
