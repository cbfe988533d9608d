"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
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


async def poll(
    predicate: Callable[[], T | Awaitable[T]], within: float = 10.0, message: str = "condition"
) -> T:
    """`wait_until` for async tests: poll ``predicate`` (sync or async) on the running loop
    until it is truthy, or fail after ``within`` seconds with the last value it gave."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last: object = None
    while True:
        try:
            result = predicate()
            value = await result if inspect.isawaitable(result) else result
        except Exception as exc:  # the condition may legitimately fail until it holds
            last = exc
        else:
            if value:
                return value
            last = value
        if loop.time() >= deadline:
            raise AssertionError(f"{message} not met after {within}s; last: {last!r}")
        await asyncio.sleep(0.05)


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of the running processes whose environment has `name`=`value`.

    Children inherit their parent's environment even when they start their own session, so a
    marker set on a command finds everything it started, however deep.
    """
    marker = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marker in environ.split(b"\0") and not process_gone(int(entry.name)):
            found.append(int(entry.name))
    return found
