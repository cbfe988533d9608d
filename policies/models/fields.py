"""The field types and the base model every policy object is built from: durations, names,
endpoint ids, header names, and the IP-address test that tells an endpoint from a DNS name."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer
from pydantic.alias_generators import to_camel

API_VERSION = "kvpilot.io/v1"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _parse_duration(value: Any) -> Any:
    """Accept ``"250ms"``, ``"5s"``, ``"2m"``, ``"1h"`` or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '5s' or '250ms'")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(
                f"{value!r} is not a duration: use a number of seconds or a string like "
                "'5s', '250ms', '2m'"
            )
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return value


def _format_duration(seconds: float) -> str:
    if seconds and seconds < 1:
        return f"{round(seconds * 1000)}ms"
    return f"{seconds:g}s"


Duration = Annotated[
    float,
    BeforeValidator(_parse_duration),
    Field(ge=0),
    PlainSerializer(_format_duration, return_type=str, when_used="json"),
]
"""Seconds in Python; ``"5s"``/``"250ms"`` strings or plain seconds on the wire."""

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$"
NAME_RULE = (
    "lowercase letters, digits, '-' and '.', at most 63 characters, "
    "starting and ending with a letter or digit"
)
Name = Annotated[
    str,
    Field(
        pattern=NAME_PATTERN,
        description=NAME_RULE[0].upper() + NAME_RULE[1:] + ".",
    ),
]
ENDPOINT_ID_PATTERN = r"^[A-Za-z0-9\[]([-A-Za-z0-9._:\[\]]{0,258}[A-Za-z0-9\]])?$"
"""A registered endpoint's id: a name, or ``address:port`` (``Endpoint.key``, what agents use)."""
ENDPOINT_ID_RULE = (
    "letters, digits, '-', '.', '_', ':', '[' and ']', at most 260 characters: "
    "a name, or address:port"
)
HeaderName = Annotated[str, Field(pattern=r"^[a-z0-9!#$%&'*+.^_`|~-]+$", max_length=128)]


class Model(BaseModel):
    """Base for every policy type: camelCase aliases, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


_IPV4 = re.compile(
    r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
)
"""The dotted quads `ipaddress` accepts (no leading zeros): a pool of 10,000 endpoints is
checked in a few milliseconds instead of a few hundred."""


def is_ip(address: str) -> bool:
    """True for an IPv4 or IPv6 address, False for a DNS name."""
    if _IPV4.fullmatch(address):
        return True
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


Capacity = Literal["on-demand", "spot", "reserved"]
"""How a replica's machine is bought: on-demand, spot (cheaper, preemptible with a notice)
or reserved (committed)."""
CAPACITIES: tuple[Capacity, ...] = ("on-demand", "spot", "reserved")
