"""Reading a benchmark's typed results back from the JSON files older runs wrote.

A results file outlives the code that wrote it: a later version may add a field (an older
file lacks it) or drop one (an older file still has it). `known` keeps the keys a dataclass
has, so ``from_json`` methods read both kinds of file the same way; a field the file lacks
takes its default (None for the optional ones), or the dataclass says which one is missing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def known(cls: type[Any], data: Mapping[str, Any], *skip: str) -> dict[str, Any]:
    """The items of `data` that are fields of the dataclass `cls`, less those in `skip` (the
    ones the caller converts itself); an optional field (``X | None``) without a default that
    `data` lacks is None. A required field it lacks is a `ValueError` naming it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name in data:
            out[f.name] = data[f.name]
        elif f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        elif _optional(f):
            out[f.name] = None
        else:
            raise ValueError(f"{cls.__name__}: the file has no {f.name!r}, which it needs")
    return out


def _optional(f: dataclasses.Field[Any]) -> bool:
    # Annotations are strings under ``from __future__ import annotations``.
    return str(f.type).replace(" ", "").endswith("|None")


def without_none(data: Mapping[str, Any], *optional: str) -> dict[str, Any]:
    """`data` without the `optional` keys whose value is None: a JSON file keeps the shape it
    always had, where an optional section was left out rather than written as null."""
    return {key: value for key, value in data.items() if key not in optional or value is not None}
