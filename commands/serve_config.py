"""The settings of `kvpilot serve`: its flags (those a container sets with an environment
variable, see ``commands.flags``; their defaults are ServeConfig's), the checks that refuse
settings that cannot work, and the ServeConfig they make."""

from __future__ import annotations

import argparse
import math
import os
import uuid
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from commands.flags import env_flag, env_list_flag, log_level_flag
from compiler import DEFAULT_FLEET
from controlplane.audit import DEFAULT_RETENTION
from controlplane.etcd import EtcdSecurity
from controlplane.etcd.keys import DEFAULT_PREFIX
from controlplane.etcd.settings import add_etcd_arguments, etcd_settings
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
    embedded_etcd_port: int = 0
    """Client port of the embedded etcd on 127.0.0.1; 0 picks a free one. A fixed port lets
    agents be pointed at it before kvpilot starts (the quickstart does)."""
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


def _default(name: str) -> Any:
    """The default of ServeConfig's field `name`: a flag's default is the config's."""
    default = next(f.default for f in fields(ServeConfig) if f.name == name)
    assert default is not MISSING, name
    return default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's flags; those a container needs read an environment variable."""
    add_etcd_arguments(
        parser,
        default_endpoints="",
        endpoints_help="comma-separated host:port list of an etcd cluster; empty starts an "
        "embedded etcd under --state-dir (env KVPILOT_ETCD_ENDPOINTS)",
    )
    for flag, what in (("--xds-address", "ADS gRPC"), ("--api-address", "REST API")):
        side = flag.removeprefix("--").partition("-")[0]
        env_flag(
            parser,
            flag,
            default=f"{_default(f'{side}_host')}:{_default(f'{side}_port')}",
            help=f"{what} listen address",
        )
    env_flag(
        parser,
        "--state-dir",
        type=Path,
        default=str(_default("state_dir")),
        help="data of the embedded etcd",
    )
    env_flag(
        parser,
        "--embedded-etcd-port",
        type=int,
        default=_default("embedded_etcd_port"),
        help="client port of the embedded etcd on 127.0.0.1 (0: a free port, printed at start)",
    )
    env_flag(
        parser,
        "--tokens-file",
        type=Path,
        help="YAML/JSON file of API bearer tokens and roles; KVPILOT_ADMIN_TOKEN and "
        "KVPILOT_READ_TOKEN also work",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve the REST API without authentication (logs a warning)",
    )
    env_flag(
        parser,
        "--xds-cert",
        help="PEM certificate of the ADS server, re-read when it changes",
    )
    env_flag(parser, "--xds-key", help="PEM private key of the ADS server")
    env_flag(parser, "--xds-client-ca", help="PEM CA bundle that signs Envoys' client certificates")
    env_list_flag(
        parser,
        "--xds-identity-fleet",
        metavar="IDENTITY=FLEET",
        help="an Envoy whose client certificate has the SAN IDENTITY (a SPIFFE ID or DNS name) "
        "may receive FLEET ('*': every fleet); a node claiming any other fleet is refused",
    )
    parser.add_argument(
        "--xds-insecure-plaintext",
        action="store_true",
        help="serve ADS without TLS: anyone who reaches the port can read any fleet's config "
        "(logs a warning; for a trusted machine only)",
    )
    env_flag(
        parser,
        "--audit-retention",
        type=int,
        default=_default("audit_retention"),
        help="audit log entries kept in etcd",
    )
    env_flag(
        parser,
        "--write-rate-limit",
        type=float,
        default=_default("write_rate"),
        help="REST writes per second allowed to each token, beyond its burst; more get 429",
    )
    env_flag(
        parser,
        "--write-burst",
        type=int,
        default=_default("write_burst"),
        help="REST writes a token may make at once",
    )
    env_list_flag(
        parser,
        "--cors-origin",
        metavar="ORIGIN",
        help="a browser origin (https://console.example.com) allowed to call the REST API; "
        "none: CORS stays closed",
    )
    for flag, help in (
        ("--quiet-period", "debounce: seconds without changes before a rebuild"),
        ("--max-wait", "debounce: longest delay from a change to its rebuild, seconds"),
        (
            "--telemetry-push-interval",
            "rebuilds caused by telemetry alone (weights, admission) at most once per this "
            "many seconds; config changes are not held",
        ),
    ):
        default = _default(flag.removeprefix("--").replace("-", "_"))
        parser.add_argument(
            flag, type=_seconds, default=default, help=f"{help} (default {default})"
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
        default=_default("default_fleet"),
        help="fleet served to Envoys whose node.cluster has no config of its own",
    )
    env_list_flag(
        parser,
        "--node-fleet",
        metavar="NODE_ID=FLEET",
        help="serve this Envoy the config of FLEET whatever its node.cluster",
    )
    env_flag(
        parser,
        "--rollout-lease-ttl",
        type=int,
        default=_default("rollout_lease_ttl"),
        help="lease of the replica driving rollouts, seconds: when it stops, another takes "
        "over within this time (after 0.6 of it without the driver's heartbeat, renewed every "
        "tenth of it)",
    )
    log_level_flag(parser)


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
    xds_host, xds_port = _host_port(args.xds_address, _default("xds_port"))
    api_host, api_port = _host_port(args.api_address, _default("api_port"))
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
        embedded_etcd_port=args.embedded_etcd_port,
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
