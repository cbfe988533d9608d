"""What every benchmark's Markdown report is made of: tables, numbers in cells, JSON blocks.

One definition of each, so every report's tables read alike and a change of format is made
once (pure, no I/O).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any


def num(value: float | None, fmt: str = "{:.3f}") -> str:
    """`value` in a report's cell: formatted by `fmt`, or "n/a" when there is none."""
    return "n/a" if value is None else fmt.format(value)


def json_block(data: Any, indent: int = 1) -> list[str]:
    """`data` as a fenced JSON block of a Markdown report, and the blank line after it."""
    return ["```json", json.dumps(data, indent=indent), "```", ""]


def row(cells: Iterable[object]) -> str:
    """One Markdown table row: ``| a | b |`` (an empty cell is ``| |``)."""
    return "|" + "|".join(f" {cell} " if str(cell) else " " for cell in cells) + "|"


def table(header: Sequence[str], rows: Iterable[Iterable[object]], align: str = "") -> list[str]:
    """A Markdown table: the header, its rule and one line per row.

    `align` has one letter per column, ``l`` (left, Markdown's default) or ``r`` (right, for
    numbers); columns it does not reach are left-aligned.
    """
    if set(align) - {"l", "r"}:
        raise ValueError(f"align takes only 'l' and 'r', got {align!r}")
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(header), "l"))
    return [row(header), rule, *(row(cells) for cells in rows)]
