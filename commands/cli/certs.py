"""``kvpilot certs``: a CA, kvpilot's ADS server certificate and one client certificate per
fleet, for mutual TLS between Envoys and kvpilot on one machine or a small setup.

Each fleet's certificate carries the SPIFFE ID ``spiffe://<trust-domain>/fleet/<fleet>``, the
identity that ``kvpilot serve --xds-identity-fleet`` binds to the fleet, and its directory
holds the two SDS files that ``kvpilot bootstrap --tls-dir`` points Envoy at. The CA is the
throwaway one the local stack uses (its key is never written: to add a fleet, make a new set).
Production certificates come from cert-manager or SPIRE instead (docs/trust.md).

Nothing is ever overwritten: if any file this would write exists, it stops before writing.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import yaml

from commands.cli.bootstrap import Endpoint, sds_files
from commands.cli.common import AddParser, CliError
from policies.models import NAME_PATTERN

SERVER_DIR = "kvpilot"
"""kvpilot's ADS server certificate, key and client CA, under ``--out``."""
DEFAULT_TRUST_DOMAIN = "kvpilot.local"
SERVER_DNS = ("kvpilot", "localhost")
"""DNS SANs of the server certificate; the bootstraps check for ``kvpilot``."""
SERVER_IPS = ("127.0.0.1",)
INSTALL_HINT = (
    "kvpilot certs needs the 'cryptography' package, which comes with the [local] extra: "
    "pip install 'kvpilot[local]' (or pip install cryptography)"
)


def fleet_dir(fleet: str) -> str:
    """The directory name of a fleet's Envoy certificate under ``--out``."""
    return f"envoy-{fleet}"


def spiffe_id(trust_domain: str, fleet: str) -> str:
    """The identity kvpilot binds to `fleet`: ``spiffe://<trust-domain>/fleet/<fleet>``."""
    return f"spiffe://{trust_domain}/fleet/{fleet}"


def _pki() -> ModuleType:
    """The local stack's CA module, or a sentence on how to install what it needs."""
    try:
        from controlplane.local import pki
    except ImportError as error:
        if (error.name or "").split(".")[0] == "cryptography":
            raise CliError(INSTALL_HINT) from None
        raise
    return pki


def _check(args: argparse.Namespace) -> list[str]:
    """The fleets to issue for, after every flag was checked; a CliError naming the flag."""
    # SPIFFE: a trust domain is lowercase letters, digits, '.', '-' and '_'.
    if not re.fullmatch(r"[a-z0-9._-]+", args.trust_domain):
        raise CliError(
            f"--trust-domain {args.trust_domain!r}: lowercase letters, digits, '.', '-' and '_' "
            "only (for example kvpilot.local or example.org)"
        )
    fleets = list(dict.fromkeys(args.fleet or ["default"]))
    for fleet in fleets:
        if not re.fullmatch(NAME_PATTERN, fleet):
            raise CliError(
                f"--fleet {fleet!r}: a fleet name is lowercase letters, digits, '-' and '.', at "
                "most 63 characters, starting and ending with a letter or digit"
            )
    for ip in args.server_ip:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise CliError(f"--server-ip {ip!r}: not an IP address") from None
    for name in args.server_dns:
        if not re.fullmatch(r"(\*\.)?[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?", name):
            raise CliError(f"--server-dns {name!r}: not a DNS name")
    Endpoint.parse(args.xds_address, flag="--xds-address")
    if args.envoy_tls_path is not None and not args.envoy_tls_path.startswith("/"):
        raise CliError(f"--envoy-tls-path {args.envoy_tls_path!r}: must be an absolute path")
    existing = [
        str(args.out / name)
        for name in ("ca.crt", SERVER_DIR, *map(fleet_dir, fleets))
        if (args.out / name).exists() or (args.out / name).is_symlink()
    ]
    if existing:
        raise CliError(
            "refusing to overwrite existing certificates and keys: "
            + ", ".join(existing)
            + "; nothing was written. Choose another --out, or remove them first"
        )
    return fleets


def _write_certs(
    pki: ModuleType, out: Path, staging: Path, args: argparse.Namespace, fleets: Sequence[str]
) -> None:
    # The CA outlives its leaves by a day, so the last leaf never outlives its issuer.
    ca = pki.Ca("kvpilot local CA", days=args.days + 1)
    (staging / "ca.crt").write_bytes(ca.cert)
    server = pki.CertDir(
        staging / SERVER_DIR,
        ca.issue(
            "kvpilot",
            dns=tuple(dict.fromkeys((*SERVER_DNS, *args.server_dns))),
            ips=tuple(dict.fromkeys((*SERVER_IPS, *args.server_ip))),
            days=args.days,
        ),
        ca.cert,
    )
    keys = [server.key]
    for fleet in fleets:
        name = fleet_dir(fleet)
        envoy = pki.CertDir(
            staging / name,
            ca.issue(f"envoy-{fleet}", uris=(spiffe_id(args.trust_domain, fleet),), days=args.days),
            ca.cert,
        )
        keys.append(envoy.key)
        tls_path = args.envoy_tls_path or str(out / name)
        for file, content in sds_files(tls_path).items():
            (envoy.path / file).write_text(yaml.safe_dump(content, sort_keys=False))
    for key in keys:
        os.chmod(key.resolve(), 0o600)


def _days(value: str) -> int:
    try:
        days = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of days") from None
    if not 1 <= days <= 3650:
        raise argparse.ArgumentTypeError(f"{days} is outside 1-3650 days")
    return days


def _expiry(path: Path) -> str:
    from cryptography import x509

    certificate = x509.load_pem_x509_certificate(path.read_bytes())
    return certificate.not_valid_after_utc.strftime("%Y-%m-%d %H:%M UTC")


def _report(out: Path, args: argparse.Namespace, fleets: Sequence[str]) -> str:
    q = shlex.quote
    server = out / SERVER_DIR
    xds = args.xds_address
    lines = [
        f"Wrote a CA, kvpilot's ADS server certificate and {len(fleets)} fleet certificate(s) "
        f"under {out} (valid until {_expiry(server / 'tls.crt')}; run `kvpilot certs` again "
        "with a new --out to renew).",
        "",
        "1. Start kvpilot with mutual TLS on ADS (the REST API needs a token: choose one):",
        "",
        "   export KVPILOT_ADMIN_TOKEN=change-me",
        f"   kvpilot serve --xds-address {q(xds)} \\",
        f"     --xds-cert {q(str(server / 'tls.crt'))} \\",
        f"     --xds-key {q(str(server / 'tls.key'))} \\",
        f"     --xds-client-ca {q(str(server / 'ca.crt'))} \\",
    ]
    bindings = [
        f"     --xds-identity-fleet {q(spiffe_id(args.trust_domain, fleet) + '=' + fleet)}"
        for fleet in fleets
    ]
    lines += [f"{b} \\" for b in bindings[:-1]] + [bindings[-1]]
    lines += ["", "2. Start an Envoy of each fleet:", ""]
    for fleet in fleets:
        lines += [
            f"   kvpilot bootstrap --fleet {q(fleet)} --xds {q(xds)} "
            f"--tls-dir {q(str(out / fleet_dir(fleet)))} > envoy-{fleet}.yaml",
            f"   envoy -c envoy-{fleet}.yaml --use-dynamic-base-id",
        ]
    lines += [
        "",
        "To run them elsewhere, copy:",
        f"  {server}/{{tls.crt,tls.key,ca.crt}} -> kvpilot's host (deploy/compose.yaml: "
        "deploy/tls/kvpilot/)",
    ]
    for fleet in fleets:
        lines.append(
            f"  {out / fleet_dir(fleet)}/{{tls.crt,tls.key,ca.crt}} -> /etc/envoy/xds-tls/ on "
            f"each Envoy of fleet {fleet} (deploy/compose.yaml: deploy/tls/envoy/)"
        )
    if args.envoy_tls_path is None:
        lines.append(
            "  with the SDS files of deploy/envoy/xds-tls/ in /etc/envoy/xds-tls-sds/ (the "
            "ones written here name this machine's paths; --envoy-tls-path /etc/envoy/xds-tls "
            "writes them for the container's)"
        )
    else:
        lines.append(
            f"  and each fleet's certificate.yaml and validation.yaml (they name "
            f"{args.envoy_tls_path}) to the --tls-dir its bootstrap reads "
            "(/etc/envoy/xds-tls-sds/ for the reference bootstrap)"
        )
    lines.append("Production certificates (cert-manager, SPIRE): docs/trust.md")
    return "\n".join(lines) + "\n"


def cmd_certs(args: argparse.Namespace) -> int:
    fleets = _check(args)
    pki = _pki()
    out: Path = args.out.resolve()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    # Everything is made in a staging directory first and moved in at the end, so a failure
    # half-way leaves nothing behind.
    staging = Path(tempfile.mkdtemp(prefix=".kvpilot-certs-", dir=out))
    try:
        _write_certs(pki, out, staging, args, fleets)
        for entry in sorted(staging.iterdir()):
            os.rename(entry, out / entry.name)
    except BaseException:
        shutil.rmtree(out if created else staging, ignore_errors=True)
        raise
    staging.rmdir()
    sys.stdout.write(_report(out, args, fleets))
    return 0


def add_parsers(add_parser: AddParser) -> None:
    """`certs`."""
    parser = add_parser(
        "certs",
        help="make a CA, kvpilot's ADS certificate and per-fleet Envoy certificates (local use)",
        description="Make a throwaway CA, kvpilot's ADS server certificate and one Envoy client "
        "certificate per fleet (SPIFFE ID spiffe://TRUST-DOMAIN/fleet/FLEET), with the SDS files "
        "Envoy reads; print the serve flags and bootstrap commands that use them. Never "
        "overwrites existing files. Needs the [local] extra (cryptography).",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("kvpilot-certs"),
        metavar="DIR",
        help="directory to write into (default ./kvpilot-certs)",
    )
    parser.add_argument(
        "--fleet",
        action="append",
        metavar="FLEET",
        help="a fleet to make an Envoy certificate for; repeatable (default: default)",
    )
    parser.add_argument(
        "--trust-domain",
        default=DEFAULT_TRUST_DOMAIN,
        help=f"SPIFFE trust domain of the Envoy identities (default {DEFAULT_TRUST_DOMAIN})",
    )
    parser.add_argument(
        "--server-dns",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name for kvpilot's certificate (it always has kvpilot and localhost); "
        "repeatable",
    )
    parser.add_argument(
        "--server-ip",
        action="append",
        default=[],
        metavar="IP",
        help="another IP address for kvpilot's certificate (it always has 127.0.0.1); repeatable",
    )
    parser.add_argument(
        "--xds-address",
        default="127.0.0.1:18000",
        metavar="HOST:PORT",
        help="kvpilot's ADS address, for the printed commands (default 127.0.0.1:18000)",
    )
    parser.add_argument(
        "--days",
        type=_days,
        default=90,
        metavar="N",
        help="how long the certificates are valid, in days (default 90; the CA a day longer)",
    )
    parser.add_argument(
        "--envoy-tls-path",
        metavar="PATH",
        help="where Envoy will find its tls.crt, tls.key and ca.crt, as the SDS files name it "
        "(default: each fleet's directory here; /etc/envoy/xds-tls matches deploy/envoy/)",
    )
    parser.set_defaults(func=cmd_certs)
