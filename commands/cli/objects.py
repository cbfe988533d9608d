"""The commands that edit and read policy objects through the REST API: ``apply`` (and its
wait for every Envoy's ACK), ``diff``, ``get``, ``delete``, ``set-weight`` and ``drain``."""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import yaml

from api.client import KvpilotClient, kind_name
from commands.cli.common import AddParser, CliError, api_client, bar, dump, load_files, table
from commands.cli.spend import pool_cost_rows, spend_rows
from commands.cli.tables import ENDPOINTS_VIEW, kinds_help, object_rows


def _ref(kind: str, name: str) -> str:
    return f"{kind.lower()}/{name}"


def cmd_apply(args: argparse.Namespace) -> int:
    objects = load_files(args.filename)
    if not objects:
        raise CliError("no objects found in " + ", ".join(str(p) for p in args.filename))
    revision = 0
    with api_client(args) as client:
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
            line = f"{bar(len(synced) / total if total else 1.0)} {len(synced)}/{total} Envoys ACKed ({elapsed:.1f}s)"
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
    with api_client(args) as client:
        if args.kind in ENDPOINTS_VIEW:
            view = client.endpoints_view()
            if args.output == "table":
                table(_endpoint_rows(view, args.name), out)
            else:
                pools = [p for p in view["pools"] if args.name in (None, p["name"])]
                dump({"pools": pools}, args.output, out)
            return 0
        if args.kind == "spend":
            view = client.spend(args.window, args.by)
            if args.output == "table":
                table(spend_rows(view), out)
                if view.get("pools"):
                    out.write("\n")
                    table(pool_cost_rows(view), out)
            else:
                dump(view, args.output, out)
            return 0
        kind = kind_name(args.kind)
        items = [client.get(kind, args.name)] if args.name else client.list_objects(kind)
    if args.output == "table":
        table(object_rows(kind, items), out)
    elif args.name:
        dump(items[0], args.output, out)
    elif args.output == "json":
        dump({"items": items}, "json", out)
    else:
        dump(items, "yaml", out, many=True)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    kind = kind_name(args.kind)
    with api_client(args) as client:
        client.delete(kind, args.name)
    print(f"{_ref(kind, args.name)} deleted")
    return 0


def cmd_set_weight(args: argparse.Namespace) -> int:
    with api_client(args) as client:
        result = client.set_weight(args.pool, args.endpoint_id, args.weight)
    print(
        f"pool/{args.pool} endpoint {args.endpoint_id} ({result.get('source', '?')}) "
        f"weight {args.weight}"
    )
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    health = "healthy" if args.undo else "draining"
    with api_client(args) as client:
        result = client.set_health(args.pool, args.endpoint_id, health)
    what = "back in rotation" if args.undo else "draining: no new request or session"
    print(f"pool/{args.pool} endpoint {args.endpoint_id} ({result.get('source', '?')}) {what}")
    return 0


def _resource_yaml(resource: dict[str, Any] | None) -> list[str]:
    if resource is None:
        return []
    return yaml.safe_dump(resource, sort_keys=False).splitlines(keepends=True)


def cmd_diff(args: argparse.Namespace) -> int:
    objects = load_files(args.filename)
    if not objects:
        raise CliError("no objects found in " + ", ".join(str(p) for p in args.filename))
    with api_client(args) as client:
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


def add_parsers(add_parser: AddParser) -> None:
    """`apply`, `diff`, `get`, `delete`, `set-weight` and `drain`."""
    apply = add_parser("apply", help="validate policy files, then create or update their objects")
    apply.add_argument(
        "-f",
        "--filename",
        type=Path,
        action="append",
        required=True,
        help="a YAML/JSON file (multi-document), a directory of them, or - for standard "
        "input; repeatable",
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
    get.add_argument("kind", help=kinds_help())
    get.add_argument(
        "name", nargs="?", help="one object (for endpoints: one pool); all when left out"
    )
    get.add_argument("-o", "--output", choices=["table", "yaml", "json"], default="table")
    get.add_argument(
        "--window",
        default="total",
        help="spend: total, or the current UTC minute, hour, day or month (default total)",
    )
    get.add_argument(
        "--by",
        default="tenant,model,pool",
        help="spend: group by tenant, model, pool, class, route (default tenant,model,pool)",
    )
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
    drain = add_parser(
        "drain",
        help="drain one endpoint (a spot replica under a preemption notice): Envoy sends it "
        "no new request or session and lets requests in flight finish",
    )
    drain.add_argument("pool")
    drain.add_argument("endpoint_id", help="a registered endpoint's id, or address:port")
    drain.add_argument("--undo", action="store_true", help="put the endpoint back (healthy)")
    drain.set_defaults(func=cmd_drain)
