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


BOOTSTRAP_CLUSTERS = ("cluster.kvpilot_xds.", "cluster.kvpilot_signals.")
"""Stat prefixes of the bootstrap's static clusters. They are STRICT_DNS: Envoy re-resolves
their address every 5 s (`dns_refresh_rate`) and counts each resolution as an update of the
cluster, with no xDS involved, so they are not xDS subscriptions."""


def xds_updates(envoy: EmbeddedEnvoy) -> dict[str, dict[str, int]]:
    """Per xDS subscription (CDS, LDS, each EDS cluster, each RDS route config), what Envoy
    counted: responses it applied (`update_success`), rejected (`update_rejected`), and
    responses it received at all (`update_attempt` minus `update_failure`).

    Envoy counts an attempt also for each failed connection to the control plane (with an
    `update_failure` beside it, say while kvpilot restarts); those are not responses, so
    `received` leaves them out.
    """
    stats = envoy.stats()
    out: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for name, value in stats.items():
        subscription, _, counter = name.rpartition(".")
        if (
            counter not in ("update_success", "update_rejected", "update_attempt")
            or name.startswith(BOOTSTRAP_CLUSTERS)
            or not isinstance(value, int)
        ):
            continue
        if counter == "update_attempt":
            failures = stats.get(f"{subscription}.update_failure", 0)
            out[subscription]["received"] = value - int(failures)
        else:
            out[subscription][counter.removeprefix("update_")] = value
    return dict(out)
