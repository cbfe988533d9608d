"""Flags that a container sets through its environment, defined once: the environment
variable's name comes from the flag's (``--write-burst`` -> ``KVPILOT_WRITE_BURST``), its value
becomes the flag's default, and the help says both.

A value from the environment goes through the flag's ``type`` like one typed on the command
line (argparse converts string defaults), so a bad ``KVPILOT_WRITE_BURST=lots`` is refused
with the flag's name, as ``--write-burst lots`` is.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

ENV_PREFIX = "KVPILOT_"


def env_name(flag: str) -> str:
    """The environment variable of `flag`: ``--xds-cert`` -> ``KVPILOT_XDS_CERT``."""
    return ENV_PREFIX + flag.removeprefix("--").upper().replace("-", "_")


def env_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    help: str,
    default: Any = None,
    type: Callable[[str], Any] | None = None,
    env: str | None = None,
    **kwargs: Any,
) -> None:
    """`flag`, its default read from `env` (named after the flag unless given), else `default`;
    the help ends with the variable and, when there is one, the default."""
    name = env or env_name(flag)
    if type is not None:
        kwargs["type"] = type
    said = f"env {name}" if default is None else f"env {name}; default {default}"
    parser.add_argument(
        flag,
        default=os.environ.get(name, default),
        help=f"{help} ({said})",
        **kwargs,
    )


def env_list_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    help: str,
    metavar: str,
    env: str | None = None,
) -> None:
    """A repeatable `flag`; its environment variable (the flag's name in the plural unless
    given) holds a comma-separated list that the values given on the command line add to."""
    name = env or env_name(flag) + "S"
    parser.add_argument(
        flag,
        action="append",
        default=[item for item in os.environ.get(name, "").split(",") if item],
        metavar=metavar,
        help=f"{help}; repeatable (env {name}, comma-separated)",
    )


def log_level_flag(parser: argparse.ArgumentParser) -> None:
    """``--log-level``, which every long-running command has."""
    env_flag(parser, "--log-level", default="info", help="debug, info, warning or error")
