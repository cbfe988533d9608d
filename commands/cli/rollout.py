"""``kvpilot rollout``: a rollout's progress drawn as text, and the pause, resume, abort and
promote commands."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from commands.cli.common import AddParser, api_client, bar, dump
from compiler.rollout import COMMANDS, TERMINAL


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
            detail = f" {bar(fraction)} {held:5.1f}s / {need:g}s"
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
    with api_client(args) as client:
        if args.verb != "status":
            result = client.rollout_command(args.name, args.verb)
            print(f"rollout/{args.name} {args.verb} requested (phase {result.get('phase')})")
            return 0
        while True:
            status = client.rollout_status(args.name)
            if args.output == "json":
                dump(status, "json", sys.stdout)
            else:
                text = render_rollout(status, time.time())
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")
                sys.stdout.write(text)
            sys.stdout.flush()
            if not args.watch or status.get("phase") in TERMINAL:
                return 0
            time.sleep(args.interval)


def add_parsers(add_parser: AddParser) -> None:
    """`rollout`."""
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
