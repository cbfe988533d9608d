"""``kvpilot bootstrap``: a ready Envoy bootstrap for one fleet, printed as YAML.

The bootstrap is built here, in code, so it ships with the wheel; ``deploy/envoy/bootstrap.yaml``
and ``bootstrap-delta.yaml`` stay as the commented reference, and a test checks that both say
the same thing (``build_bootstrap`` for the reference's parameters gives the reference file,
apart from the ``node`` block that the reference leaves to Envoy's command line).

Envoy facts it encodes (each seen with the real 1.40 binary): ``node.id`` and ``node.cluster``
are required for ADS, and kvpilot keys fleets on ``node.cluster``; the xDS cluster must speak
HTTP/2 or Envoy never connects although ``--mode validate`` passes; without a control plane
Envoy waits 15 s per initial fetch unless ``initial_fetch_timeout`` says otherwise; and a
second Envoy on one machine needs ``--use-dynamic-base-id``, a command-line flag, which the
printed header says to pass.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from commands.cli.common import AddParser, CliError
from policies.models import NAME_PATTERN

XDS_CLUSTER = "kvpilot_xds"
"""The static cluster that carries ADS."""
SIGNALS_CLUSTER = "kvpilot_signals"
"""The static cluster of kvpilot's access log service (the same gRPC port as ADS)."""
SERVER_NAME = "kvpilot"
"""The SNI Envoy sends and the DNS SAN it expects on kvpilot's certificate."""
REFERENCE_SDS_DIR = "/etc/envoy/xds-tls-sds"
"""Where the reference bootstrap reads its SDS files; the default of ``--tls-dir``."""
CLIENT_CERTIFICATE_SECRET = "xds_client_certificate"
SERVER_VALIDATION_SECRET = "xds_server_validation"
CERTIFICATE_SDS_FILE = "certificate.yaml"
VALIDATION_SDS_FILE = "validation.yaml"


@dataclass(frozen=True)
class Endpoint:
    """A ``HOST:PORT`` that Envoy can resolve (a name, an IPv4 or a bracketed IPv6 address)."""

    host: str
    port: int

    @classmethod
    def parse(cls, value: str, *, flag: str) -> Endpoint:
        """``HOST:PORT``; a clear error naming `flag` otherwise."""
        match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]\s]+):(\d+)", value)
        if match is None:
            raise CliError(
                f"{flag} {value!r}: expected HOST:PORT (for example 127.0.0.1:18000, "
                "kvpilot.example.svc:18000 or [::1]:18000)"
            )
        host = match.group(1) or match.group(3)
        port = int(match.group(2) or match.group(4))
        if not 1 <= port <= 65535:
            raise CliError(f"{flag} {value!r}: port {port} is not between 1 and 65535")
        if match.group(1) is not None:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise CliError(f"{flag} {value!r}: {host!r} is not an IPv6 address") from None
        elif not re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", host):
            raise CliError(f"{flag} {value!r}: {host!r} is not a host name or IP address")
        return cls(host, port)


def _point(name: str, endpoint: Endpoint) -> dict[str, Any]:
    address = {"socket_address": {"address": endpoint.host, "port_value": endpoint.port}}
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
    }


def _sds(path: str, directory: str) -> dict[str, Any]:
    # watched_directory: Envoy re-reads the SDS file when the directory changes (a Kubernetes
    # volume swaps its ..data symlink), so a renewed certificate needs no restart.
    return {
        "path_config_source": {"path": path, "watched_directory": {"path": directory}},
        "resource_api_version": "V3",
    }


def _transport_socket(sds_dir: str) -> dict[str, Any]:
    """Mutual TLS to kvpilot: the client certificate and the server check, both from SDS files."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": SERVER_NAME,
            "common_tls_context": {
                "tls_certificate_sds_secret_configs": [
                    {
                        "name": CLIENT_CERTIFICATE_SECRET,
                        "sds_config": _sds(f"{sds_dir}/{CERTIFICATE_SDS_FILE}", sds_dir),
                    }
                ],
                "validation_context_sds_secret_config": {
                    "name": SERVER_VALIDATION_SECRET,
                    "sds_config": _sds(f"{sds_dir}/{VALIDATION_SDS_FILE}", sds_dir),
                },
            },
        },
    }


def _grpc_cluster(name: str, endpoint: Endpoint, sds_dir: str | None) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STRICT_DNS",
        "connect_timeout": "1s",
        # gRPC: the cluster must speak HTTP/2, or Envoy never connects (validate still passes).
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "connection_keepalive": {"interval": "30s", "timeout": "5s"}
                    }
                },
            }
        },
    }
    if sds_dir is not None:
        cluster["transport_socket"] = _transport_socket(sds_dir)
    cluster["load_assignment"] = _point(name, endpoint)
    return cluster


def _ads_source() -> dict[str, Any]:
    # Without a control plane Envoy otherwise waits 15 s per initial fetch before serving.
    return {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "5s"}


def build_bootstrap(
    *,
    fleet: str,
    xds: Endpoint,
    node_id: str | None,
    delta: bool = False,
    sds_dir: str | None = REFERENCE_SDS_DIR,
    admin_port: int = 9901,
) -> dict[str, Any]:
    """The bootstrap of an Envoy in `fleet` fed by kvpilot at `xds` over one ADS stream.

    `sds_dir` holds the SDS files ``certificate.yaml`` and ``validation.yaml``; None speaks
    plaintext to kvpilot (which then needs ``--xds-insecure-plaintext``). `node_id` None leaves
    ``node`` out, as the reference does (``--service-node``/``--service-cluster`` set it).
    """
    config: dict[str, Any] = {}
    if node_id is not None:
        config["node"] = {"id": node_id, "cluster": fleet}
    config["admin"] = {
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
    }
    # A cap on downstream connections; Envoy warns at start without one.
    config["overload_manager"] = {
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": 50000,
                },
            }
        ]
    }
    # Internal listeners carry an external provider's credential header on its path only.
    config["bootstrap_extensions"] = [
        {
            "name": "envoy.bootstrap.internal_listener",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
            },
        }
    ]
    config["dynamic_resources"] = {
        "ads_config": {
            "api_type": "DELTA_GRPC" if delta else "GRPC",
            "transport_api_version": "V3",
            "set_node_on_first_message_only": True,
            "grpc_services": [
                {
                    "envoy_grpc": {
                        "cluster_name": XDS_CLUSTER,
                        # Jittered back-off from 0.25 s to 2 s: Envoy's default grows to 30 s.
                        "retry_policy": {
                            "retry_back_off": {"base_interval": "0.25s", "max_interval": "2s"}
                        },
                    }
                }
            ],
        },
        "cds_config": _ads_source(),
        "lds_config": _ads_source(),
    }
    config["static_resources"] = {
        "clusters": [
            _grpc_cluster(XDS_CLUSTER, xds, sds_dir),
            _grpc_cluster(SIGNALS_CLUSTER, xds, sds_dir),
        ]
    }
    return config


def sds_files(tls_dir: str) -> dict[str, dict[str, Any]]:
    """The two SDS files (name -> content) for an Envoy whose ``tls.crt``, ``tls.key`` and
    ``ca.crt`` are in `tls_dir`: its client certificate, and how it checks kvpilot's."""
    secret = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
    watched = {"path": tls_dir}
    return {
        CERTIFICATE_SDS_FILE: {
            "resources": [
                {
                    "@type": secret,
                    "name": CLIENT_CERTIFICATE_SECRET,
                    "tls_certificate": {
                        "certificate_chain": {"filename": f"{tls_dir}/tls.crt"},
                        "private_key": {"filename": f"{tls_dir}/tls.key"},
                        "watched_directory": watched,
                    },
                }
            ]
        },
        VALIDATION_SDS_FILE: {
            "resources": [
                {
                    "@type": secret,
                    "name": SERVER_VALIDATION_SECRET,
                    "validation_context": {
                        "trusted_ca": {"filename": f"{tls_dir}/ca.crt"},
                        "watched_directory": dict(watched),
                        "match_typed_subject_alt_names": [
                            {"san_type": "DNS", "matcher": {"exact": SERVER_NAME}}
                        ],
                    },
                }
            ]
        },
    }


def _header(args: argparse.Namespace, sds_dir: str | None) -> str:
    lines = [
        f"# Envoy bootstrap for fleet {args.fleet!r}, fed by kvpilot at {args.xds} "
        f"({'Delta' if args.delta else 'State-of-the-World'} ADS).",
        "# Start it (the dynamic base id lets several Envoys share a machine):",
        "#   envoy -c THIS_FILE --use-dynamic-base-id",
    ]
    if sds_dir is None:
        lines.append("# Plaintext ADS: kvpilot must run with --xds-insecure-plaintext.")
    else:
        lines.append(
            f"# Mutual TLS: SDS files {sds_dir}/{CERTIFICATE_SDS_FILE} and "
            f"{VALIDATION_SDS_FILE} (made by `kvpilot certs`)."
        )
    lines.append("# Reference with comments: deploy/envoy/bootstrap.yaml; docs: docs/trust.md.")
    return "\n".join(lines) + "\n"


def cmd_bootstrap(args: argparse.Namespace) -> int:
    if not re.fullmatch(NAME_PATTERN, args.fleet):
        raise CliError(
            f"--fleet {args.fleet!r}: a fleet name is lowercase letters, digits, '-' and '.', "
            "at most 63 characters, starting and ending with a letter or digit"
        )
    xds = Endpoint.parse(args.xds, flag="--xds")
    if not 0 <= args.admin_port <= 65535:
        raise CliError(f"--admin-port {args.admin_port}: not between 0 and 65535")
    node_id = args.node_id if args.node_id is not None else f"{args.fleet}-{socket.gethostname()}"
    if not node_id.strip():
        raise CliError("--node-id: must not be empty")
    sds_dir: str | None = None
    if not args.plaintext:
        sds_dir = str(args.tls_dir.resolve()) if args.tls_dir is not None else REFERENCE_SDS_DIR
        if args.tls_dir is not None:
            missing = [
                name
                for name in (CERTIFICATE_SDS_FILE, VALIDATION_SDS_FILE)
                if not (args.tls_dir / name).is_file()
            ]
            if missing:
                # Not an error: the bootstrap may be meant for another machine or a container.
                print(
                    f"warning: --tls-dir {args.tls_dir}: no {' or '.join(missing)} there yet; "
                    "`kvpilot certs` writes both into each fleet's directory",
                    file=sys.stderr,
                )
    config = build_bootstrap(
        fleet=args.fleet,
        xds=xds,
        node_id=node_id,
        delta=args.delta,
        sds_dir=sds_dir,
        admin_port=args.admin_port,
    )
    sys.stdout.write(_header(args, sds_dir))
    yaml.safe_dump(config, sys.stdout, sort_keys=False, default_flow_style=False)
    return 0


def add_parsers(add_parser: AddParser) -> None:
    """`bootstrap`."""
    parser = add_parser(
        "bootstrap",
        help="print an Envoy bootstrap (YAML) for one fleet, fed by kvpilot over ADS",
        description="Print a ready Envoy bootstrap to stdout: "
        "kvpilot bootstrap --fleet edge --xds 127.0.0.1:18000 --tls-dir kvpilot-certs/envoy-edge "
        "> envoy.yaml && envoy -c envoy.yaml --use-dynamic-base-id",
    )
    parser.add_argument("--fleet", required=True, help="the fleet (node.cluster) of this Envoy")
    parser.add_argument(
        "--xds",
        required=True,
        metavar="HOST:PORT",
        help="kvpilot's ADS address (serve --xds-address)",
    )
    parser.add_argument(
        "--delta",
        action="store_true",
        help="use the Delta xDS protocol (default State-of-the-World)",
    )
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument(
        "--tls-dir",
        type=Path,
        metavar="DIR",
        help="directory with the SDS files certificate.yaml and validation.yaml (`kvpilot certs` "
        f"writes them into each fleet's directory); default {REFERENCE_SDS_DIR}",
    )
    tls.add_argument(
        "--plaintext",
        action="store_true",
        help="no TLS to kvpilot (kvpilot then runs with --xds-insecure-plaintext)",
    )
    parser.add_argument(
        "--node-id", metavar="ID", help="node.id, unique per Envoy (default FLEET-HOSTNAME)"
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        default=9901,
        metavar="N",
        help="port of Envoy's admin interface on 127.0.0.1 (default 9901; 0 picks a free one)",
    )
    parser.set_defaults(func=cmd_bootstrap)
