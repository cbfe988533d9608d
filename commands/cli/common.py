"""What every ``kvpilot`` command shares: its one-line error, the API client that the global
options name, loading policy files, and printing (YAML or JSON, tables, progress bars)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from api.client import KvpilotClient
from policies import (
    PolicyError,
    PolicyObject,
    decode_documents,
    parse_object,
)

AddParser = Callable[..., argparse.ArgumentParser]
"""``add_parser(name, help=...)`` of the ``kvpilot`` parser: a command group adds its
subcommands with it."""


class CliError(Exception):
    """An error reported as one line on stderr, exit code 1."""


def dump(data: Any, output: str, out: TextIO, *, many: bool = False) -> None:
    if output == "json":
        json.dump(data, out, indent=2, sort_keys=False)
        out.write("\n")
    elif many:
        yaml.safe_dump_all(data, out, sort_keys=False, default_flow_style=False)
    else:
        yaml.safe_dump(data, out, sort_keys=False, default_flow_style=False)


def table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
        out.write("\n")


BAR_WIDTH = 30


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A progress bar for a fraction from 0 to 1 (Envoys ACKed, a rollout step held)."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


STDIN = Path("-")
"""``-f -``: the documents come from standard input (a heredoc, a pipe)."""


def _files(paths: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path == STDIN:
            files.append(path)
        elif path.is_dir():
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
        data = sys.stdin.buffer.read() if file == STDIN else file.read_bytes()
        try:
            documents = decode_documents(data, source="<stdin>" if file == STDIN else str(file))
        except PolicyError as error:
            problems.append(str(error))
            continue
        for index, document in enumerate(documents):
            source = f"{'<stdin>' if file == STDIN else file} (document {index + 1})"
            try:
                objects.append(parse_object(document, source=source))
            except PolicyError as error:
                problems.extend(f"{error.source}: {problem}" for problem in error.errors)
    if problems:
        raise CliError(
            f"{len(problems)} problem(s) found, nothing was applied:\n  " + "\n  ".join(problems)
        )
    return objects


def api_client(args: argparse.Namespace) -> KvpilotClient:
    return KvpilotClient(args.server, token=args.token or None)
