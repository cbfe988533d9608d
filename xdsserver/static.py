"""Fleet resources as a static Envoy bootstrap, so `envoy --mode validate` can check them.

Envoy validates dynamic resources only when it receives them; a static bootstrap carrying the
same clusters (with their endpoints inlined) and listeners (with their routes inlined) gets the
same checks offline. The golden tests run every example through it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.bootstrap.internal_listener.v3 import internal_listener_pb2
from envoy.extensions.filters.http.credential_injector.v3 import credential_injector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.injected_credentials.generic.v3 import generic_pb2
from google.protobuf import json_format

from xdsserver.translate import FleetResources


def static_bootstrap(fleet: FleetResources) -> bootstrap_pb2.Bootstrap:
    """A bootstrap with every resource of `fleet` inlined (EDS -> STATIC, RDS -> route_config)."""
    assignments = {cla.cluster_name: cla for cla in fleet.endpoints}
    routes = {route.name: route for route in fleet.routes}
    bootstrap = bootstrap_pb2.Bootstrap()
    bootstrap.node.id = "validate"
    bootstrap.node.cluster = "validate"
    bootstrap.bootstrap_extensions.add(name="envoy.bootstrap.internal_listener").typed_config.Pack(
        internal_listener_pb2.InternalListener()
    )
    for source in fleet.clusters:
        cluster = bootstrap.static_resources.clusters.add()
        cluster.CopyFrom(source)
        if not cluster.HasField("eds_cluster_config"):
            continue  # DNS and aggregate clusters are valid as they are
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
                _stub_secret_files(manager.http_filters, bootstrap)
                network_filter.typed_config.Pack(manager)
                if manager.HasField("rds"):
                    route_config = routes.get(manager.rds.route_config_name)
                    manager.ClearField("rds")
                    if route_config is not None:
                        manager.route_config.CopyFrom(route_config)
                    network_filter.typed_config.Pack(manager)
    return bootstrap


def _stub_secret_files(
    http_filters: Iterable[hcm_pb2.HttpFilter], bootstrap: bootstrap_pb2.Bootstrap
) -> None:
    """Secrets live in files on each Envoy host, which this machine need not have: point each
    credential injector at a static placeholder secret of the same name instead."""
    for http_filter in http_filters:
        if http_filter.name != "envoy.filters.http.credential_injector":
            continue
        injector = credential_injector_pb2.CredentialInjector()
        http_filter.typed_config.Unpack(injector)
        generic = generic_pb2.Generic()
        injector.credential.typed_config.Unpack(generic)
        name = generic.credential.name
        generic.credential.ClearField("sds_config")
        injector.credential.typed_config.Pack(generic)
        http_filter.typed_config.Pack(injector)
        if name not in {secret.name for secret in bootstrap.static_resources.secrets}:
            secret = bootstrap.static_resources.secrets.add(name=name)
            secret.generic_secret.secret.inline_string = "placeholder"


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
