"""``kvpilot``: run the daemon, edit policy through the REST API, or translate files offline.

Exit codes: 0 success, 1 error (one line on stderr), 2 usage error.

The commands live in groups, one module each: ``objects`` (apply, diff, get, delete,
set-weight, drain), ``status`` (status, audit), ``rollout``, ``translate`` (offline), ``certs`` and
``bootstrap`` (mutual TLS and Envoy start-up, offline), ``docs`` (generated pages),
``completion``; ``common`` holds what
they share. ``serve`` is ``commands.serve``; ``agent`` is ``commands.agent``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence
from typing import Any

from api.client import DEFAULT_SERVER, ClientError
from commands.cli import (
    bootstrap,
    certs,
    completion,
    difficulty,
    docs,
    objects,
    rollout,
    status,
    translate,
)
from commands.cli.common import AddParser, CliError, load_files
from commands.cli.objects import wait_for_envoys
from commands.cli.rollout import render_rollout

__all__ = ["CliError", "build_parser", "load_files", "main", "render_rollout", "wait_for_envoys"]


def cmd_serve(args: argparse.Namespace) -> int:
    from commands import serve

    result = serve.run(args)
    return int(result or 0)


def _add_serve(add_parser: AddParser) -> None:
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


def version() -> str:
    """kvpilot's version, from the installed package's metadata (pyproject's version)."""
    try:
        return importlib.metadata.version("kvpilot")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpilot",
        description="LLM-inference-aware control plane for Envoy.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
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
    from commands import agent as agent_command

    agent_command.add_arguments(agent)
    agent.set_defaults(func=agent_command.run)

    objects.add_parsers(add_parser)
    status.add_parsers(add_parser)
    rollout.add_parsers(add_parser)
    translate.add_parsers(add_parser)
    certs.add_parsers(add_parser)
    bootstrap.add_parsers(add_parser)
    docs.add_parsers(add_parser)
    completion.add_parsers(add_parser, parser)
    difficulty.add_parsers(add_parser)
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
