"""Fleet resources as a static Envoy bootstrap, so `envoy --mode validate` can check them.

Envoy validates dynamic resources only when it receives them; a static bootstrap carrying the
same clusters (with their endpoints inlined) and listeners (with their routes inlined) gets the
same checks offline. Tests and `kvpilot translate --validate` use this.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf import json_format

from xdsserver.translate import FleetResources


def static_bootstrap(fleet: FleetResources) -> bootstrap_pb2.Bootstrap:
    """A bootstrap with every resource of `fleet` inlined (EDS -> STATIC, RDS -> route_config)."""
    assignments = {cla.cluster_name: cla for cla in fleet.endpoints}
    routes = {route.name: route for route in fleet.routes}
    bootstrap = bootstrap_pb2.Bootstrap()
    bootstrap.node.id = "validate"
    bootstrap.node.cluster = "validate"
    for source in fleet.clusters:
        cluster = bootstrap.static_resources.clusters.add()
        cluster.CopyFrom(source)
        service = cluster.eds_cluster_config.service_name or cluster.name
        cluster.ClearField("eds_cluster_config")
        cluster.type = cluster_pb2.Cluster.STATIC
        if service in assignments:
            cluster.load_assignment.CopyFrom(assignments[service])
        cluster.load_assignment.cluster_name = cluster.name
    for source in fleet.listeners:
        listener = bootstrap.static_resources.listeners.add()
        listener.CopyFrom(source)
        for chain in listener.filter_chains:
            for network_filter in chain.filters:
                if network_filter.name != "envoy.filters.network.http_connection_manager":
                    continue
                manager = hcm_pb2.HttpConnectionManager()
                network_filter.typed_config.Unpack(manager)
                if manager.HasField("rds"):
                    route_config = routes.get(manager.rds.route_config_name)
                    manager.ClearField("rds")
                    if route_config is not None:
                        manager.route_config.CopyFrom(route_config)
                    network_filter.typed_config.Pack(manager)
    return bootstrap


def validate_with_envoy(fleet: FleetResources, envoy: Path, workdir: Path) -> tuple[bool, str]:
    """Run `envoy --mode validate` on the fleet's resources; (ok, Envoy's output)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "static-bootstrap.json"
    path.write_text(json_format.MessageToJson(static_bootstrap(fleet)))
    result = subprocess.run(
        [str(envoy), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id", "-l", "error"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.returncode == 0, (result.stdout + result.stderr).strip()
