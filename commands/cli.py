"""``kvpilot``: run the daemon, edit policy through the REST API, or translate files offline.

Exit codes: 0 success, 1 error (one line on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml

from api.client import DEFAULT_SERVER, ClientError, KvpilotClient, kind_name
from policies import PolicyError, PolicyObject, PolicyState, decode_documents, parse_object


class CliError(Exception):
    """An error reported as one line on stderr, exit code 1."""


# --------------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------------


def _dump(data: Any, output: str, out: TextIO, *, many: bool = False) -> None:
    if output == "json":
        json.dump(data, out, indent=2, sort_keys=False)
        out.write("\n")
    elif many:
        yaml.safe_dump_all(data, out, sort_keys=False, default_flow_style=False)
    else:
        yaml.safe_dump(data, out, sort_keys=False, default_flow_style=False)


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
        out.write("\n")


def _files(paths: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(
                sorted(p for p in path.iterdir() if p.suffix in {".yaml", ".yml", ".json"})
            )
        elif path.exists():
            files.append(path)
        else:
            raise CliError(f"{path}: no such file or directory")
    return files


def load_files(paths: Sequence[Path]) -> list[PolicyObject]:
    """Validate every document of every file; report all problems at once."""
    objects: list[PolicyObject] = []
    problems: list[str] = []
    for file in _files(paths):
        try:
            documents = decode_documents(file.read_text(), source=str(file))
        except PolicyError as error:
            problems.append(str(error))
            continue
        for index, document in enumerate(documents):
            source = f"{file} (document {index + 1})"
            try:
                objects.append(parse_object(document, source=source))
            except PolicyError as error:
                problems.extend(f"{error.source}: {problem}" for problem in error.errors)
    if problems:
        raise CliError(
            f"{len(problems)} problem(s) found, nothing was applied:\n  " + "\n  ".join(problems)
        )
    return objects


def _client(args: argparse.Namespace) -> KvpilotClient:
    return KvpilotClient(args.server, token=args.token or None)


def _ref(kind: str, name: str) -> str:
    return f"{kind.lower()}/{name}"


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def cmd_apply(args: argparse.Namespace) -> int:
    objects = load_files(args.filename)
    if not objects:
        raise CliError("no objects found in " + ", ".join(str(p) for p in args.filename))
    with _client(args) as client:
        for obj in objects:
            outcome = client.apply(obj.model_dump(mode="json", by_alias=True))
            print(f"{_ref(obj.kind, obj.metadata.name)} {outcome}")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    kind = kind_name(args.kind)
    with _client(args) as client:
        if args.name:
            _dump(client.get(kind, args.name), args.output, sys.stdout)
        else:
            items = client.list_objects(kind)
            if args.output == "json":
                _dump({"items": items}, "json", sys.stdout)
            else:
                _dump(items, "yaml", sys.stdout, many=True)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    kind = kind_name(args.kind)
    with _client(args) as client:
        client.delete(kind, args.name)
    print(f"{_ref(kind, args.name)} deleted")
    return 0


def cmd_set_weight(args: argparse.Namespace) -> int:
    with _client(args) as client:
        result = client.set_weight(args.pool, args.endpoint_id, args.weight)
    print(
        f"pool/{args.pool} endpoint {args.endpoint_id} ({result.get('source', '?')}) "
        f"weight {args.weight}"
    )
    return 0


def _when(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.status()
    out = sys.stdout
    if args.output == "json":
        _dump(status, "json", out)
        return 0
    envoys = status.get("envoys", [])
    rows = [["NODE", "FLEET", "MODE", "CDS", "EDS", "LDS", "RDS", "LAST NACK"]]
    for envoy in envoys:
        types = {t.get("type"): t for t in envoy.get("types", {}).values()}
        nacks = [
            f"{name}: {t['last_nack']['message']}"
            for name, t in sorted(types.items())
            if t.get("last_nack")
        ]
        rows.append(
            [
                str(envoy.get("node_id", "")),
                str(envoy.get("fleet", "")),
                str(envoy.get("mode", "")),
                *(
                    types.get(name, {}).get("version_acked") or "-"
                    for name in ("CDS", "EDS", "LDS", "RDS")
                ),
                "; ".join(nacks)[:120] or "-",
            ]
        )
    out.write(f"Envoys connected: {len(envoys)}\n")
    _table(rows, out)
    for refused in status.get("refusedEnvoys", []):
        out.write(
            f"refused: {refused.get('node_id')} ({refused.get('count')}x, last "
            f"{_when(refused.get('at'))}): {refused.get('message')}\n"
        )
    build = status.get("lastBuild", {})
    out.write(
        f"\nLast build: revision {build.get('revision')} at {_when(build.get('at'))} "
        f"({(build.get('seconds') or 0) * 1000:.1f} ms, "
        f"{build.get('path', 'full')} path)\n"
    )
    for fleet, versions in sorted(build.get("fleets", {}).items()):
        out.write(f"  fleet {fleet}: " + ", ".join(f"{v}" for v in versions.values()) + "\n")
    for error in status.get("invalidObjects", []):
        out.write(f"invalid in etcd: {error.get('key')}: {error.get('message')}\n")
    for diagnostic in status.get("diagnostics", []):
        out.write(
            f"{diagnostic.get('severity')}: {diagnostic.get('kind')}/{diagnostic.get('name')}"
            f"{' at ' + diagnostic['path'] if diagnostic.get('path') else ''}: "
            f"{diagnostic.get('message')}\n"
        )
    return 0


def _change(op: dict[str, Any]) -> str:
    if op.get("op") == "add":
        return f"{op.get('path')} = {json.dumps(op.get('value'))}"
    if op.get("op") == "remove":
        return f"{op.get('path')} removed (was {json.dumps(op.get('old'))})"
    return f"{op.get('path')}: {json.dumps(op.get('old'))} -> {json.dumps(op.get('value'))}"


def cmd_audit(args: argparse.Namespace) -> int:
    with _client(args) as client:
        entries = client.audit(args.limit)
    out = sys.stdout
    if args.output == "json":
        _dump(entries, "json", out)
        return 0
    rows = [["WHEN", "WHO", "ACTION", "OBJECT", "REVISION", "CHANGES"]]
    for entry in entries:
        obj = entry.get("object", {})
        where = f"{obj.get('pool')}/" if obj.get("pool") else ""
        diff = entry.get("diff", [])
        rows.append(
            [
                _when(entry.get("at")),
                str(entry.get("actor", "")),
                str(entry.get("action", "")),
                f"{obj.get('kind')}/{where}{obj.get('name')}",
                f"{entry.get('revisionBefore') or '-'} -> {entry.get('revisionAfter')}",
                "; ".join(_change(op) for op in diff)[:100] or "-",
            ]
        )
    _table(rows, out)
    return 0


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
    _dump(result["fleets"], args.output, sys.stdout)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from commands import serve

    result = serve.run(args)
    return int(result or 0)


# --------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------


def _add_serve(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    parser = add_parser("serve", help="run the control plane (etcd watch, ADS server, REST API)")
    from commands import serve

    serve.add_arguments(parser)
    parser.set_defaults(func=cmd_serve)


def _add_global_options(parser: argparse.ArgumentParser, server: Any, token: Any) -> None:
    parser.add_argument(
        "--server",
        default=server,
        help=f"REST API URL (env KVPILOT_SERVER, default {DEFAULT_SERVER})",
    )
    parser.add_argument("--token", default=token, help="API bearer token (env KVPILOT_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpilot",
        description="LLM-inference-aware control plane for Envoy.",
    )
    _add_global_options(
        parser, os.environ.get("KVPILOT_SERVER", DEFAULT_SERVER), os.environ.get("KVPILOT_TOKEN")
    )
    # The same options after the subcommand (`kvpilot get pools --server URL`); SUPPRESS keeps
    # the subcommand from overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    _add_global_options(common, argparse.SUPPRESS, argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add_parser(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = subparsers.add_parser(name, parents=[common], **kwargs)
        return parser

    _add_serve(add_parser)
    agent = add_parser(
        "agent", help="scrape backends' metrics into etcd telemetry (and register them)"
    )
    from controlplane import agent as agent_command

    agent_command.add_arguments(agent)
    agent.set_defaults(func=agent_command.run)

    apply = add_parser("apply", help="validate policy files, then create or update their objects")
    apply.add_argument(
        "-f",
        "--filename",
        type=Path,
        action="append",
        required=True,
        help="a YAML/JSON file (multi-document) or a directory of them; repeatable",
    )
    apply.set_defaults(func=cmd_apply)

    get = add_parser("get", help="show objects")
    get.add_argument("kind", help="pool, routingpolicy or fleet (plural works too)")
    get.add_argument("name", nargs="?", help="one object; all of the kind when left out")
    get.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    get.set_defaults(func=cmd_get)

    delete = add_parser("delete", help="delete an object")
    delete.add_argument("kind")
    delete.add_argument("name")
    delete.set_defaults(func=cmd_delete)

    weight = add_parser("set-weight", help="change one endpoint's weight")
    weight.add_argument("pool")
    weight.add_argument("endpoint_id", help="a registered endpoint's id, or address:port")
    weight.add_argument("weight", type=int)
    weight.set_defaults(func=cmd_set_weight)

    status = add_parser("status", help="connected Envoys, problems, last build")
    status.add_argument("-o", "--output", choices=["table", "json"], default="table")
    status.set_defaults(func=cmd_status)

    audit = add_parser("audit", help="who changed what: the newest audit entries")
    audit.add_argument("--limit", type=int, default=50, help="entries to show (default 50)")
    audit.add_argument("-o", "--output", choices=["table", "json"], default="table")
    audit.set_defaults(func=cmd_audit)

    translate = add_parser(
        "translate", help="print the Envoy resources for policy files (offline: no server)"
    )
    translate.add_argument("-f", "--filename", type=Path, action="append", required=True)
    translate.add_argument("--fleet", help="only this fleet's resources")
    translate.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    translate.set_defaults(func=cmd_translate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (CliError, ClientError) as error:
        message = str(error)
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error. Point stdout at devnull so the
        # interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
