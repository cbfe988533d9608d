"""The settings of `kvpilot serve`: its flags (each with an environment variable, for
containers), the checks that refuse settings that cannot work, and the ServeConfig they make."""

from __future__ import annotations

import argparse
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from controlplane.audit import DEFAULT_RETENTION
from controlplane.etcd import EtcdSecurity
from controlplane.etcdsettings import add_etcd_arguments, etcd_settings
from controlplane.keys import DEFAULT_PREFIX
from policies import DEFAULT_FLEET
from xdsserver.identity import FleetBinding, TlsFiles


@dataclass
class ServeConfig:
    """Everything the daemon needs (`kvpilot serve` builds it from its flags)."""

    etcd_endpoints: list[str] = field(default_factory=list)
    etcd_security: EtcdSecurity = field(default_factory=EtcdSecurity)
    """TLS files and user/password for etcd."""
    prefix: str = DEFAULT_PREFIX
    xds_host: str = "0.0.0.0"
    xds_port: int = 18000
    api_host: str = "0.0.0.0"
    api_port: int = 8080
    state_dir: Path = Path(".state")
    tokens_file: Path | None = None
    insecure_no_auth: bool = False
    quiet_period: float = 0.02
    max_wait: float = 0.25
    telemetry_push_interval: float = 1.0
    default_fleet: str = DEFAULT_FLEET
    node_fleets: dict[str, str] = field(default_factory=dict)
    """Envoy node id -> fleet, overriding the node's own node.cluster."""
    etcd_embedded: bool = False
    """True when `run` started an embedded etcd for this daemon."""
    xds_tls: TlsFiles | None = None
    """ADS over mutual TLS: server certificate, key and the CA that signs Envoys' certificates."""
    xds_identity_fleets: list[str] = field(default_factory=list)
    """``IDENTITY=FLEET`` bindings: which fleets an Envoy's certificate identity may receive."""
    xds_insecure_plaintext: bool = False
    """Serve ADS without TLS (any process that reaches the port gets any fleet's config)."""
    audit_retention: int = DEFAULT_RETENTION
    """Audit entries kept in etcd; older ones are deleted."""
    write_rate: float = 20.0
    """REST writes per second per token (a token bucket)."""
    write_burst: int = 100
    """Writes a token may make at once before the rate applies."""
    cors_origins: list[str] = field(default_factory=list)
    """Browser origins allowed to call the REST API; empty keeps CORS closed."""
    replica_id: str = field(default_factory=lambda: f"{os.uname().nodename}-{uuid.uuid4().hex[:6]}")
    rollout_lease_ttl: int = 10
    """Seconds the replica driving rollouts may be silent before another takes over."""


def _host_port(value: str, default_port: int) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host:
        return value, default_port
    return host.strip("[]"), int(port)


def _seconds(text: str) -> float:
    """A duration flag: a finite number of seconds, zero or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be finite and not negative")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's flags; each has an environment variable for containers."""
    env = os.environ.get
    add_etcd_arguments(
        parser,
        default_endpoints="",
        endpoints_help="comma-separated host:port list of an etcd cluster; empty starts an "
        "embedded etcd under --state-dir (env KVPILOT_ETCD_ENDPOINTS)",
    )
    parser.add_argument(
        "--xds-address",
        default=env("KVPILOT_XDS_ADDRESS", "0.0.0.0:18000"),
        help="ADS gRPC listen address (env KVPILOT_XDS_ADDRESS)",
    )
    parser.add_argument(
        "--api-address",
        default=env("KVPILOT_API_ADDRESS", "0.0.0.0:8080"),
        help="REST API listen address (env KVPILOT_API_ADDRESS)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(env("KVPILOT_STATE_DIR", ".state")),
        help="data of the embedded etcd (env KVPILOT_STATE_DIR)",
    )
    parser.add_argument(
        "--tokens-file",
        type=Path,
        default=env("KVPILOT_TOKENS_FILE"),
        help="YAML/JSON file of API bearer tokens and roles (env KVPILOT_TOKENS_FILE); KVPILOT_ADMIN_TOKEN and KVPILOT_READ_TOKEN also work",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve the REST API without authentication (logs a warning)",
    )
    parser.add_argument(
        "--xds-cert",
        default=env("KVPILOT_XDS_CERT"),
        help="PEM certificate of the ADS server (env KVPILOT_XDS_CERT); re-read when it changes",
    )
    parser.add_argument(
        "--xds-key",
        default=env("KVPILOT_XDS_KEY"),
        help="PEM private key of the ADS server (env KVPILOT_XDS_KEY)",
    )
    parser.add_argument(
        "--xds-client-ca",
        default=env("KVPILOT_XDS_CLIENT_CA"),
        help="PEM CA bundle that signs Envoys' client certificates (env KVPILOT_XDS_CLIENT_CA)",
    )
    parser.add_argument(
        "--xds-identity-fleet",
        action="append",
        default=[e for e in env("KVPILOT_XDS_IDENTITY_FLEETS", "").split(",") if e],
        metavar="IDENTITY=FLEET",
        help="an Envoy whose client certificate has the SAN IDENTITY (a SPIFFE ID or DNS name) "
        "may receive FLEET ('*': every fleet); repeatable (env KVPILOT_XDS_IDENTITY_FLEETS, "
        "comma-separated). A node claiming any other fleet is refused",
    )
    parser.add_argument(
        "--xds-insecure-plaintext",
        action="store_true",
        help="serve ADS without TLS: anyone who reaches the port can read any fleet's config "
        "(logs a warning; for a trusted machine only)",
    )
    parser.add_argument(
        "--audit-retention",
        type=int,
        default=int(env("KVPILOT_AUDIT_RETENTION", str(DEFAULT_RETENTION))),
        help=f"audit log entries kept in etcd (env KVPILOT_AUDIT_RETENTION; default "
        f"{DEFAULT_RETENTION})",
    )
    parser.add_argument(
        "--write-rate-limit",
        type=float,
        default=float(env("KVPILOT_WRITE_RATE_LIMIT", "20")),
        help="REST writes per second allowed to each token, beyond its burst; more get 429 "
        "(env KVPILOT_WRITE_RATE_LIMIT; default 20)",
    )
    parser.add_argument(
        "--write-burst",
        type=int,
        default=int(env("KVPILOT_WRITE_BURST", "100")),
        help="REST writes a token may make at once (env KVPILOT_WRITE_BURST; default 100)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[e for e in env("KVPILOT_CORS_ORIGINS", "").split(",") if e],
        metavar="ORIGIN",
        help="a browser origin (https://console.example.com) allowed to call the REST API; "
        "repeatable (env KVPILOT_CORS_ORIGINS, comma-separated). None: CORS stays closed",
    )
    parser.add_argument(
        "--quiet-period",
        type=_seconds,
        default=0.02,
        help="debounce: seconds without changes before a rebuild (default 0.02)",
    )
    parser.add_argument(
        "--max-wait",
        type=_seconds,
        default=0.25,
        help="debounce: longest delay from a change to its rebuild, seconds (default 0.25)",
    )
    parser.add_argument(
        "--telemetry-push-interval",
        type=_seconds,
        default=1.0,
        help="rebuilds caused by telemetry alone (weights, admission) at most once per this many "
        "seconds; config changes are not held (default 1.0)",
    )
    parser.add_argument(
        "--replica-id",
        default=None,
        help="this replica's name in etcd (Envoy status, data-plane signals, spend records); "
        "keep it across restarts (a pod name, say) and the replica continues from the spend it "
        "stored (default: host name and a random suffix)",
    )
    parser.add_argument(
        "--default-fleet",
        default=DEFAULT_FLEET,
        help="fleet served to Envoys whose node.cluster has no config of its own",
    )
    parser.add_argument(
        "--node-fleet",
        action="append",
        default=[e for e in env("KVPILOT_NODE_FLEETS", "").split(",") if e],
        metavar="NODE_ID=FLEET",
        help="serve this Envoy the config of FLEET whatever its node.cluster; repeatable "
        "(env KVPILOT_NODE_FLEETS, comma-separated)",
    )
    parser.add_argument(
        "--rollout-lease-ttl",
        type=int,
        default=int(env("KVPILOT_ROLLOUT_LEASE_TTL", "10")),
        help="lease of the replica driving rollouts, seconds: when it stops, another takes "
        "over within this time (after 0.6 of it without the driver's heartbeat, renewed every "
        "tenth of it) (env KVPILOT_ROLLOUT_LEASE_TTL, default 10)",
    )
    parser.add_argument(
        "--log-level",
        default=env("KVPILOT_LOG_LEVEL", "info"),
        help="debug, info, warning or error",
    )


def _node_fleets(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        node, sep, fleet = value.partition("=")
        if not sep or not node or not fleet:
            raise SystemExit(f"--node-fleet takes NODE_ID=FLEET, not {value!r}")
        out[node] = fleet
    return out


def _xds_tls(args: argparse.Namespace) -> TlsFiles | None:
    files = (args.xds_cert, args.xds_key, args.xds_client_ca)
    if args.xds_insecure_plaintext:
        if any(files):
            raise SystemExit(
                "--xds-insecure-plaintext and --xds-cert/--xds-key/--xds-client-ca "
                "exclude each other: choose one"
            )
        return None
    if not all(files):
        raise SystemExit(
            "ADS needs mutual TLS: pass --xds-cert, --xds-key and --xds-client-ca (and bind "
            "certificate identities to fleets with --xds-identity-fleet), or run with "
            "--xds-insecure-plaintext on a trusted machine"
        )
    return TlsFiles(Path(args.xds_cert), Path(args.xds_key), Path(args.xds_client_ca))


def check_xds(config: ServeConfig) -> None:
    """Refuse to start with ADS settings that cannot work; the message says what to pass."""
    if config.xds_tls is None:
        return
    if not config.xds_identity_fleets:
        raise SystemExit(
            "ADS over mutual TLS refuses every Envoy until an identity is bound to a fleet: pass "
            "--xds-identity-fleet SAN=FLEET (for example spiffe://example.org/fleet/edge=edge)"
        )
    try:
        config.xds_tls.check()
    except ValueError as error:
        raise SystemExit(str(error)) from None


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Turn parsed flags into a ServeConfig."""
    xds_host, xds_port = _host_port(args.xds_address, 18000)
    api_host, api_port = _host_port(args.api_address, 8080)
    try:
        FleetBinding.parse(args.xds_identity_fleet)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    etcd = etcd_settings(args, os.environ)
    return ServeConfig(
        etcd_endpoints=etcd.endpoints,
        etcd_security=etcd.security,
        prefix=etcd.prefix,
        xds_host=xds_host,
        xds_port=xds_port,
        api_host=api_host,
        api_port=api_port,
        state_dir=args.state_dir,
        tokens_file=Path(args.tokens_file) if args.tokens_file else None,
        insecure_no_auth=args.insecure_no_auth,
        quiet_period=args.quiet_period,
        max_wait=args.max_wait,
        telemetry_push_interval=args.telemetry_push_interval,
        default_fleet=args.default_fleet,
        node_fleets=_node_fleets(args.node_fleet),
        rollout_lease_ttl=args.rollout_lease_ttl,
        xds_tls=_xds_tls(args),
        xds_identity_fleets=list(args.xds_identity_fleet),
        xds_insecure_plaintext=args.xds_insecure_plaintext,
        audit_retention=args.audit_retention,
        write_rate=args.write_rate_limit,
        write_burst=args.write_burst,
        cors_origins=list(args.cors_origin),
        **({"replica_id": args.replica_id} if args.replica_id else {}),
    )
