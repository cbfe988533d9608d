"""The command-line pieces every benchmark shares: the common flags, comma lists of names
checked against a table, and ``--out`` applied to a config."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Config = TypeVar("_Config", bound="DataclassInstance")


class UsageError(Exception):
    """Flags that do not make a run: ``python -m bench`` prints the sentence and exits 2."""


class UnknownNames(UsageError):
    """A flag's comma list named something the benchmark does not have."""


def add_common(parser: argparse.ArgumentParser) -> None:
    """The flags of every benchmark."""
    parser.add_argument("--short", action="store_true", help="a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="output directory (bench/results)")
    parser.add_argument("--state-dir", type=Path, default=None, help="keep logs here")


def names(text: str, known: Iterable[str], what: str) -> tuple[str, ...]:
    """The names in the comma list `text`, each one of `known`."""
    wanted = tuple(name.strip() for name in text.split(",") if name.strip())
    known = list(known)
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise UnknownNames(f"unknown {what} {unknown}; known: {known}")
    return wanted


def with_out(config: _Config, args: argparse.Namespace) -> _Config:
    """`config` writing to ``--out`` when given (every benchmark config has `out_dir`)."""
    return config if args.out is None else replace(config, out_dir=args.out)
