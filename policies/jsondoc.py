"""JSON text as kvpilot reads it from anywhere outside (REST bodies, values in etcd).

Python's `json` would accept what JSON does not (NaN, Infinity), silently keep the last of two
equal keys, and recurse once per nesting level until it raises `RecursionError`. Here each of
those is a `JsonError` (a `ValueError`) with a sentence, so every caller answers bad input the
same way, and no input reaches the models deeper than `MAX_DEPTH` levels.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted. kvpilot's own objects need under 10."""


class JsonError(ValueError):
    """The text is not JSON kvpilot accepts; the message says why."""


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and they cannot be written back.
    raise JsonError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"{text} is out of range for a number")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise JsonError(f"the key {key!r} appears twice in one object")
        result[key] = value
    return result


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON (bytes may be UTF-8, -16 or -32); `JsonError` for anything else."""
    try:
        value = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise JsonError(f"it is nested more than {max_depth} levels deep") from None
    except JsonError:
        raise
    except (ValueError, UnicodeDecodeError) as error:
        # ValueError also covers integers longer than Python's digit limit.
        raise JsonError(str(error)) from None
    if depth_exceeds(value, max_depth):
        raise JsonError(f"it is nested more than {max_depth} levels deep")
    return value


def depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays and objects (lists and dicts) nest deeper than `limit` levels."""
    # Iterative: the check itself must not recurse on hostile input.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
