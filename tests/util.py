"""Small helpers shared by the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
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
