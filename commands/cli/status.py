"""The commands that report what the daemon sees: ``status`` (connected Envoys, problems, the
last build) and ``audit`` (who changed what)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from commands.cli.common import AddParser, api_client, dump, table


def _when(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")


def cmd_status(args: argparse.Namespace) -> int:
    out = sys.stdout
    with api_client(args) as client:
        if not args.watch:
            _print_status(client.status(), args.output, out)
            return 0
        # Redraw in place on a terminal; elsewhere (a pipe, a log) print each frame after a
        # time stamp. Ctrl-C ends it, also when this process was started by one that
        # ignores or blocks SIGINT (a child inherits both, and would never stop).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
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
        dump(status, "json", out)
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
    table(rows, out)
    for envoy in envoys:
        warming = envoy.get("warming")
        if warming:
            out.write(
                f"warming: {envoy.get('node_id')} since {_when(warming.get('since'))}: "
                f"{', '.join(warming.get('clusters', []))} (its route changes wait)\n"
            )
    for refused in status.get("refusedEnvoys", []):
        out.write(
            f"refused {refused.get('service', 'ads')}: {refused.get('node_id')} "
            f"({refused.get('count')}x, last "
            f"{_when(refused.get('at'))}): {refused.get('message')}\n"
        )
    _print_rollouts(status, out)
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


def _print_rollouts(status: dict[str, Any], out: TextIO) -> None:
    """The rollouts and the replica that drives them (one replica steps every rollout)."""
    rollouts = status.get("rollouts", [])
    driver = status.get("rolloutDriver")
    since = status.get("rolloutDriverSince")
    who = (
        f"driven by replica {driver} since {_when(since)}"
        if driver
        else "no replica drives rollouts now"
    )
    out.write(f"\nRollouts: {len(rollouts)} ({who})\n")
    if not rollouts:
        return
    rows = [["NAME", "TARGET", "PHASE", "STEP", "WEIGHTS", "VERDICT", "MESSAGE"]]
    for rollout in rollouts:
        target = rollout.get("target") or {}
        step = rollout.get("step")
        steps = rollout.get("steps") or []
        weights = rollout.get("weights") or {}
        verdict = rollout.get("verdict") or {}
        rows.append(
            [
                str(rollout.get("name", "")),
                f"{target.get('policy', '?')}/{target.get('route', '?')}",
                str(rollout.get("phase", "")),
                "-" if step is None else f"{step + 1}/{len(steps)}",
                " ".join(f"{pool}={weight}%" for pool, weight in weights.items()) or "-",
                str(verdict.get("outcome") or "-"),
                str(rollout.get("message") or "-")[:80],
            ]
        )
    table(rows, out)


def _change(op: dict[str, Any]) -> str:
    if op.get("op") == "add":
        return f"{op.get('path')} = {json.dumps(op.get('value'))}"
    if op.get("op") == "remove":
        return f"{op.get('path')} removed (was {json.dumps(op.get('old'))})"
    return f"{op.get('path')}: {json.dumps(op.get('old'))} -> {json.dumps(op.get('value'))}"


def cmd_audit(args: argparse.Namespace) -> int:
    with api_client(args) as client:
        entries = client.audit(args.limit)
    out = sys.stdout
    if args.output == "json":
        dump(entries, "json", out)
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
    table(rows, out)
    return 0


def add_parsers(add_parser: AddParser) -> None:
    """`status` and `audit`."""
    status = add_parser("status", help="connected Envoys, problems, last build")
    status.add_argument("-o", "--output", choices=["table", "json"], default="table")
    status.add_argument(
        "-w", "--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C"
    )
    status.add_argument(
        "--interval", type=float, default=2.0, help="seconds between --watch redraws (default 2)"
    )
    status.set_defaults(func=cmd_status)

    audit = add_parser("audit", help="who changed what: the newest audit entries")
    audit.add_argument("--limit", type=int, default=50, help="entries to show (default 50)")
    audit.add_argument("-o", "--output", choices=["table", "json"], default="table")
    audit.set_defaults(func=cmd_audit)
