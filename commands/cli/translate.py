"""``kvpilot translate``: the Envoy resources for policy files, offline (no server, no
etcd): the same compile and translation the daemon runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commands.cli.common import AddParser, CliError, dump, load_files
from signals import PolicyState


def cmd_translate(args: argparse.Namespace) -> int:
    from api.preview import preview

    objects = load_files(args.filename)
    result = preview(PolicyState.from_objects(objects), fleet=args.fleet)
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
    dump(result["fleets"], args.output, sys.stdout)
    return 0


def add_parsers(add_parser: AddParser) -> None:
    """`translate`."""
    translate = add_parser(
        "translate", help="print the Envoy resources for policy files (offline: no server)"
    )
    translate.add_argument("-f", "--filename", type=Path, action="append", required=True)
    translate.add_argument("--fleet", help="only this fleet's resources")
    translate.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    translate.set_defaults(func=cmd_translate)
