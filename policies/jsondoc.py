"""JSON text as kvpilot reads it from anywhere outside (REST bodies, values in etcd).

Python's `json` would accept what JSON does not (NaN, Infinity), silently keep the last of two
equal keys, and recurse once per nesting level until it raises `RecursionError`. Here each of
those is a `JsonError` (a `ValueError`) with a sentence, so every caller answers bad input the
same way, and no input reaches the models deeper than `MAX_DEPTH` levels.

Most text is parsed by jiter (pydantic's JSON parser, in Rust), which catches duplicate keys
itself and is several times faster than `json` with a Python hook per object: at 10,000
endpoints parsing was a fifth of a full rebuild. Whatever jiter refuses, and whatever it
accepts that `json` would not (a number that overflows to infinity), goes through `json` with
the checks above, so the outcome and every error message are `json`'s.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jiter

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
        value = jiter.from_json(
            text.encode() if isinstance(text, str) else text,
            allow_inf_nan=False,
            catch_duplicate_keys=True,
        )
    except (ValueError, UnicodeEncodeError):
        pass  # `json` decides, and says why
    else:
        exceeds, finite = _shape(value, max_depth)
        if exceeds:
            raise JsonError(f"it is nested more than {max_depth} levels deep")
        if finite:
            return value
    return _loads_strict(text, max_depth)


def _loads_strict(text: str | bytes, max_depth: int) -> Any:
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
    return _shape(value, limit)[0]


_CONTAINERS = (dict, list)


def _shape(value: Any, limit: int) -> tuple[bool, bool]:
    """(nests deeper than `limit`, every float in it is finite), in one walk.

    Level by level and iterative: the check itself must not recurse on hostile input, and it
    visits only containers' children, the one pass a 10,000-endpoint document needs."""
    level = [value] if isinstance(value, _CONTAINERS) else []
    finite = not isinstance(value, float) or math.isfinite(value)
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True, finite
        deeper = []
        for item in level:
            for child in item.values() if isinstance(item, dict) else item:
                kind = child.__class__
                if kind is dict or kind is list:
                    deeper.append(child)
                elif kind is float and not math.isfinite(child):
                    finite = False
        level = deeper
    return False, finite
