"""Waiting on a condition with a deadline: tests never sleep a fixed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


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
