"""``kvpilot translate``: the Envoy resources for policy files, offline (no server, no
etcd): the same compile and translation the daemon runs (``xdsserver.render``).

``--telemetry FILE`` adds the agents' records (pool -> endpoint id -> record, as in etcd), so
the output shows what live signals do: endpoint weights and health (EDS), the saturated twin
a session route takes and the admitted share of each service class (RDS). ``--diff`` prints
only the resources the telemetry changed, before and after."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from commands.cli.common import AddParser, CliError, dump, load_files
from policies import PolicyError, decode_documents


def _telemetry(path: Path) -> Any:
    try:
        documents = decode_documents(path.read_bytes(), source=str(path))
    except OSError as error:
        raise CliError(f"--telemetry {path}: {error.strerror}") from None
    except PolicyError as error:
        raise CliError(str(error)) from None
    if len(documents) != 1:
        raise CliError(
            f"--telemetry {path}: expected one document (pool -> endpoint id -> record), "
            f"found {len(documents)}"
        )
    document = documents[0]
    # A golden test input (or any file with a `telemetry:` section) works as well.
    if isinstance(document, dict) and isinstance(document.get("telemetry"), dict):
        return document["telemetry"]
    return document


def cmd_translate(args: argparse.Namespace) -> int:
    from xdsserver.render import (
        RenderInput,
        newest_record,
        parse_telemetry,
        render_input,
        resource_changes,
    )

    objects = load_files(args.filename)
    telemetry = {}
    if args.telemetry is not None:
        try:
            telemetry = parse_telemetry(_telemetry(args.telemetry))
        except PolicyError as error:
            raise CliError(f"--telemetry {args.telemetry}: {error}") from None
    now = args.now if args.now is not None else newest_record(telemetry) or 0.0
    given = RenderInput(objects=objects, telemetry=telemetry, now=now)
    result = render_input(given, fleet=args.fleet)
    for diagnostic in result["diagnostics"]:
        where = f" at {diagnostic['path']}" if diagnostic["path"] else ""
        print(
            f"{diagnostic['severity']}: {diagnostic['kind']}/{diagnostic['name']}{where}: "
            f"{diagnostic['message']}",
            file=sys.stderr,
        )
    if args.fleet is not None and args.fleet not in result["fleets"]:
        known = ", ".join(sorted(result["fleets"])) or "none"
        raise CliError(
            f"fleet {args.fleet!r} gets no configuration from these files (fleets: {known})"
        )
    if args.diff:
        if args.telemetry is None:
            raise CliError("--diff shows what --telemetry changes: give --telemetry FILE")
        without = render_input(RenderInput(objects=objects, now=now), fleet=args.fleet)
        dump(resource_changes(without["fleets"], result["fleets"]), args.output, sys.stdout)
        return 0
    dump(result["fleets"], args.output, sys.stdout)
    return 0


def add_parsers(add_parser: AddParser) -> None:
    """`translate`."""
    translate = add_parser(
        "translate", help="print the Envoy resources for policy files (offline: no server)"
    )
    translate.add_argument("-f", "--filename", type=Path, action="append", required=True)
    translate.add_argument("--fleet", help="only this fleet's resources")
    translate.add_argument(
        "--telemetry",
        type=Path,
        metavar="FILE",
        help="agents' telemetry records (YAML or JSON: pool -> address:port -> record) that "
        "live weights, saturation and admission read",
    )
    translate.add_argument(
        "--now",
        type=float,
        metavar="SECONDS",
        help="the clock telemetry ages are measured against, Unix seconds (default: the "
        "newest record's time, so the records count as fresh)",
    )
    translate.add_argument(
        "--diff",
        action="store_true",
        help="print only the resources the telemetry changes, before and after",
    )
    translate.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    translate.set_defaults(func=cmd_translate)
