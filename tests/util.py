"""Small helpers shared by the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from bench.backend import BackendProcess
    from controlplane.launchers import EmbeddedEnvoy

T = TypeVar("T")

EnvoyFactory = Callable[..., "EmbeddedEnvoy"]
"""What the `envoy_factory` fixture returns: keyword arguments of EmbeddedEnvoy -> started Envoy."""

BackendFactory = Callable[..., "BackendProcess"]
"""What the `backends` fixture returns: (n, id_prefix=...) -> started BackendProcess."""


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition not met",
) -> T:
    """Poll `predicate` until it returns a truthy value, and return that value.

    Tests never sleep a fixed time: they poll with a deadline. On timeout this raises
    AssertionError with `message` and the last value (or exception) the predicate gave.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except Exception as exc:  # the condition may legitimately fail until it holds
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (after {timeout:.1f}s; last value: {last!r})")
        time.sleep(interval)


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")
