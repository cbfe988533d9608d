"""``kvpilot``: run the daemon, edit policy through the REST API, or translate files offline.

Exit codes: 0 success, 1 error (one line on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml

from api.client import DEFAULT_SERVER, ClientError, KvpilotClient, kind_name
from policies import (
    PolicyError,
    PolicyObject,
    PolicyState,
    Pool,
    decode_documents,
    parse_object,
)
from policies.rollout import COMMANDS, TERMINAL


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
            documents = decode_documents(file.read_bytes(), source=str(file))
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
    revision = 0
    with _client(args) as client:
        for obj in objects:
            applied = client.apply(obj.model_dump(mode="json", by_alias=True))
            revision = max(revision, applied.revision or 0)
            print(f"{_ref(obj.kind, obj.metadata.name)} {applied.outcome}")
        if args.wait:
            wait_for_envoys(client, revision, timeout=args.timeout, out=sys.stdout)
    return 0


def _sync(status: dict[str, Any], revision: int) -> tuple[bool, list[str], list[str]]:
    """(built, Envoys in sync, Envoys still waiting) for the config built at ``revision`` or
    later; raises CliError naming the Envoy and its message when one rejected it."""
    build = status.get("lastBuild", {})
    if (build.get("revision") or 0) < revision:
        return False, [], []
    fleets = build.get("fleets", {})
    default = fleets.get(build.get("defaultFleet", "default"), {})
    synced: list[str] = []
    waiting: list[str] = []
    for envoy in status.get("envoys", []):
        served = fleets.get(envoy.get("fleet"), default)
        name = f"{envoy.get('node_id')} ({envoy.get('fleet')}, replica {envoy.get('replica')})"
        ok = True
        for type_url, state in envoy.get("types", {}).items():
            want = served.get(type_url)
            if want is None or state.get("version_acked") == want:
                continue
            nack = state.get("last_nack")
            if nack and nack.get("version") == want:
                raise CliError(
                    f"Envoy {name} rejected the new {state.get('type')} configuration: "
                    f"{nack.get('message')}"
                )
            ok = False
        (synced if ok else waiting).append(name)
    return True, synced, waiting


def wait_for_envoys(
    client: KvpilotClient, revision: int, *, timeout: float, out: TextIO, interval: float = 0.2
) -> None:
    """Wait until kvpilot has built the config of ``revision`` and every connected Envoy has
    ACKed it, with a progress bar (redrawn in place on a terminal, one line per step
    otherwise). CliError on a NACK or when ``timeout`` passes."""
    started = time.monotonic()
    interactive = out.isatty()
    last = ""
    while True:
        built, synced, waiting = _sync(client.status(), revision)
        total = len(synced) + len(waiting)
        elapsed = time.monotonic() - started
        if not built:
            line = f"waiting for kvpilot to build revision {revision} ({elapsed:.1f}s)"
        else:
            line = f"{_bar(len(synced) / total if total else 1.0)} {len(synced)}/{total} Envoys ACKed ({elapsed:.1f}s)"
        if interactive:
            out.write("\r\x1b[K" + line)
            out.flush()
        elif line.split(" (")[0] != last.split(" (")[0]:
            out.write(line + "\n")
        last = line
        if built and not waiting:
            if interactive:
                out.write("\n")
            if not total:
                out.write(f"revision {revision} is built; no Envoy is connected\n")
            else:
                out.write(f"all {total} Envoys run revision {revision} or later\n")
            return
        if elapsed > timeout:
            if interactive:
                out.write("\n")
            behind = ", ".join(waiting) or "kvpilot has not built it yet"
            raise CliError(
                f"not every Envoy ACKed revision {revision} within {timeout:g}s: {behind}; "
                "see `kvpilot status`"
            )
        time.sleep(interval)


def _join(values: Any, limit: int = 3) -> str:
    items = [str(v) for v in values or []]
    shown = ",".join(items[:limit])
    return (shown + f",+{len(items) - limit}" if len(items) > limit else shown) or "-"


def _object_rows(kind: str, items: list[dict[str, Any]]) -> list[list[str]]:
    """A table of objects of one kind: the columns that tell them apart at a glance."""
    if kind == "Pool":
        rows = [["NAME", "MODELS", "ENDPOINTS", "PROTOCOL", "EXTERNAL"]]
        for item in items:
            spec = item.get("spec", {})
            try:
                obj = parse_object(item)
                external = "yes" if isinstance(obj, Pool) and obj.spec.external else "no"
            except PolicyError:
                external = "?"
            rows.append(
                [
                    item["metadata"]["name"],
                    _join(spec.get("models")),
                    str(len(spec.get("endpoints", []))),
                    str(spec.get("protocol", "-")),
                    external,
                ]
            )
    elif kind == "RoutingPolicy":
        rows = [["NAME", "LISTENER", "FLEETS", "ROUTES"]]
        for item in items:
            spec = item.get("spec", {})
            listener = spec.get("listener", {})
            rows.append(
                [
                    item["metadata"]["name"],
                    f"{listener.get('address', '')}:{listener.get('port', '')}",
                    _join(spec.get("fleets")),
                    _join([route.get("name") for route in spec.get("routes", [])]),
                ]
            )
    else:
        rows = [["NAME", "MAX BODY", "SECRETS DIR", "ACCESS LOG"]]
        for item in items:
            spec = item.get("spec", {})
            rows.append(
                [
                    item["metadata"]["name"],
                    str(spec.get("maxRequestBodyBytes", "-")),
                    str(spec.get("secretsDir", "-")),
                    str(spec.get("accessLog", "-")).lower(),
                ]
            )
    return rows


def _endpoint_rows(view: dict[str, Any], pool: str | None) -> list[list[str]]:
    rows = [["POOL", "ENDPOINT", "HEALTH", "WEIGHT", "SENT", "QUEUE", "KV", "AGE", "WHY"]]
    for entry in view.get("pools", []):
        if pool is not None and entry["name"] != pool:
            continue
        for endpoint in entry["endpoints"]:
            telemetry = endpoint.get("telemetry") or {}
            kv = telemetry.get("kv_cache")
            age = endpoint.get("telemetryAge")
            rows.append(
                [
                    entry["name"],
                    endpoint["id"],
                    endpoint["effectiveHealth"],
                    str(endpoint["weight"]),
                    str(endpoint["effectiveWeight"]),
                    "-" if telemetry.get("waiting") is None else f"{telemetry['waiting']:g}",
                    "-" if kv is None else f"{kv:.0%}",
                    "-" if age is None else f"{age:.0f}s",
                    "; ".join(endpoint.get("reasons", [])) or "-",
                ]
            )
    return rows


def cmd_get(args: argparse.Namespace) -> int:
    out = sys.stdout
    with _client(args) as client:
        if args.kind in ("endpoints", "endpoint", "ep"):
            view = client.endpoints_view()
            if args.output == "table":
                _table(_endpoint_rows(view, args.name), out)
            else:
                pools = [p for p in view["pools"] if args.name in (None, p["name"])]
                _dump({"pools": pools}, args.output, out)
            return 0
        kind = kind_name(args.kind)
        items = [client.get(kind, args.name)] if args.name else client.list_objects(kind)
    if args.output == "table":
        _table(_object_rows(kind, items), out)
    elif args.name:
        _dump(items[0], args.output, out)
    elif args.output == "json":
        _dump({"items": items}, "json", out)
    else:
        _dump(items, "yaml", out, many=True)
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
    out = sys.stdout
    with _client(args) as client:
        if not args.watch:
            _print_status(client.status(), args.output, out)
            return 0
        # Redraw in place on a terminal; elsewhere (a pipe, a log) print each frame after a
        # time stamp. Ctrl-C ends it.
        try:
            while True:
                status = client.status()
                if out.isatty():
                    out.write("\x1b[H\x1b[2J")
                else:
                    out.write(f"--- {_when(time.time())}\n")
                _print_status(status, args.output, out)
                out.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def _print_status(status: dict[str, Any], output: str, out: TextIO) -> None:
    if output == "json":
        _dump(status, "json", out)
        return
    etcd = status.get("etcd") or {}
    if etcd.get("endpoints"):
        out.write(
            f"etcd: {','.join(etcd['endpoints'])}"
            f"{' (embedded)' if etcd.get('embedded') else ''}"
            f"{'' if etcd.get('watching') is not False else ' UNREACHABLE'}\n"
        )
    envoys = status.get("envoys", [])
    rows = [["NODE", "FLEET", "MODE", "CDS", "EDS", "LDS", "RDS", "LAST NACK"]]
    for envoy in envoys:
        types = {t.get("type"): t for t in envoy.get("types", {}).values()}
        nacks = [
            f"{name}: {t['last_nack']['message']}"
            + (" (resolved)" if t["last_nack"].get("resolved") else "")
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


def _resource_yaml(resource: dict[str, Any] | None) -> list[str]:
    if resource is None:
        return []
    return yaml.safe_dump(resource, sort_keys=False).splitlines(keepends=True)


def cmd_diff(args: argparse.Namespace) -> int:
    objects = load_files(args.filename)
    if not objects:
        raise CliError("no objects found in " + ", ".join(str(p) for p in args.filename))
    with _client(args) as client:
        result = client.preview([obj.model_dump(mode="json", by_alias=True) for obj in objects])
    out = sys.stdout
    for entry in result["objects"]:
        out.write(f"{entry['kind'].lower()}/{entry['name']} would be {entry['outcome']}\n")
    for diagnostic in result["diagnostics"]:
        where = f" at {diagnostic['path']}" if diagnostic["path"] else ""
        out.write(
            f"{diagnostic['severity']}: {diagnostic['kind']}/{diagnostic['name']}{where}: "
            f"{diagnostic['message']}\n"
        )
    changes = result["changes"]
    if not changes:
        out.write("no change to any Envoy's configuration\n")
        return 0
    counts: dict[str, int] = {}
    for change in changes:
        counts[change["change"]] = counts.get(change["change"], 0) + 1
        label = f"fleet {change['fleet']} {change['type']} {change['name']}"
        out.write(
            "".join(
                difflib.unified_diff(
                    _resource_yaml(change["before"]),
                    _resource_yaml(change["after"]),
                    f"{label} (now)",
                    f"{label} (after apply)",
                    n=3,
                )
            )
        )
    summary = ", ".join(f"{count} {what}" for what, count in sorted(counts.items()))
    out.write(f"Envoy resources: {summary}\n")
    return 0


BAR_WIDTH = 30


def _bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A progress bar for a fraction from 0 to 1 (Envoys ACKed, a rollout step held)."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def render_rollout(status: dict[str, Any], now: float) -> str:
    """A rollout's progress as text: one line per step with a bar for the current one, then
    the current verdict's numbers."""
    lines = [
        f"rollout/{status.get('name')}  {status.get('phase')}"
        + (f"  ({status['message']})" if status.get("message") else "")
    ]
    current = status.get("step")
    for index, weights in enumerate(status.get("steps", [])):
        split = " ".join(f"{pool}={weight}%" for pool, weight in weights.items())
        if current is None or index > current:
            mark = "  "
            detail = ""
        elif index < current or status.get("phase") == "Succeeded":
            mark = "ok"
            detail = ""
        else:
            mark = ">>"
            started = status.get("stepStartedAt") or now
            need = float(status.get("minDuration") or 0)
            held = max(0.0, now - float(started))
            fraction = 1.0 if need <= 0 else held / need
            if status.get("phase") in ("RolledBack", "Aborted", "Failed"):
                mark = "xx"
            detail = f" {_bar(fraction)} {held:5.1f}s / {need:g}s"
            if status.get("fleets"):
                detail += f" (fleets {', '.join(status['fleets'])} only)"
        lines.append(f" {mark} step {index}: {split}{detail}")
    verdict = status.get("verdict") or {}
    if verdict:
        canary = verdict.get("canary", {})
        stable = verdict.get("stable", {})
        lines.append(
            f" verdict {verdict.get('outcome')}: canary {canary.get('requests', 0)} requests "
            f"{canary.get('errors', 0)} errors, stable {stable.get('requests', 0)} requests "
            f"{stable.get('errors', 0)} errors"
        )
        for rule in verdict.get("rules", []):
            values = " ".join(
                f"{key}={rule[key]:.4g}"
                for key in ("canary", "stable", "limit")
                if isinstance(rule.get(key), int | float)
            )
            lines.append(
                f"   {rule.get('rule')}: {rule.get('outcome')} {values} {rule.get('message') or ''}".rstrip()
            )
    if status.get("failedRequests"):
        lines.append(f" canary requests failed so far: {status['failedRequests']}")
    return "\n".join(lines) + "\n"


def cmd_rollout(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.verb != "status":
            result = client.rollout_command(args.name, args.verb)
            print(f"rollout/{args.name} {args.verb} requested (phase {result.get('phase')})")
            return 0
        while True:
            status = client.rollout_status(args.name)
            if args.output == "json":
                _dump(status, "json", sys.stdout)
            else:
                text = render_rollout(status, time.time())
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")
                sys.stdout.write(text)
            sys.stdout.flush()
            if not args.watch or status.get("phase") in TERMINAL:
                return 0
            time.sleep(args.interval)


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
    from controlplane import agentcli as agent_command

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
    apply.add_argument(
        "--wait",
        action="store_true",
        help="then wait, with a progress bar, until every connected Envoy has ACKed the result",
    )
    apply.add_argument(
        "--timeout", type=float, default=60.0, help="seconds --wait waits (default 60)"
    )
    apply.set_defaults(func=cmd_apply)

    diff = add_parser(
        "diff",
        help="show what applying policy files would change in the Envoy resources of every "
        "fleet (nothing is written)",
    )
    diff.add_argument("-f", "--filename", type=Path, action="append", required=True)
    diff.set_defaults(func=cmd_diff)

    get = add_parser("get", help="show objects, or endpoints with their live weight and health")
    get.add_argument("kind", help="pool, routingpolicy or fleet (plural works too), or endpoints")
    get.add_argument(
        "name", nargs="?", help="one object (for endpoints: one pool); all when left out"
    )
    get.add_argument("-o", "--output", choices=["table", "yaml", "json"], default="table")
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
    status.add_argument(
        "-w", "--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C"
    )
    status.add_argument(
        "--interval", type=float, default=2.0, help="seconds between --watch redraws (default 2)"
    )
    status.set_defaults(func=cmd_status)

    rollout = add_parser(
        "rollout", help="a rollout's progress, or pause, resume, abort or promote it"
    )
    rollout.add_argument("verb", choices=["status", *COMMANDS])
    rollout.add_argument("name")
    rollout.add_argument(
        "-w", "--watch", action="store_true", help="status: redraw until the rollout ends"
    )
    rollout.add_argument(
        "--interval", type=float, default=1.0, help="seconds between redraws (default 1)"
    )
    rollout.add_argument("-o", "--output", choices=["text", "json"], default="text")
    rollout.set_defaults(func=cmd_rollout)
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
