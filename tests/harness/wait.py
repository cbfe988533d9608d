"""Waiting on a condition with a deadline: tests never sleep a fixed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class _Attempts:
    """The deadline of one wait and the last thing its predicate gave, for the failure."""

    def __init__(self, within: float, message: str) -> None:
        self._deadline = time.monotonic() + within
        self._within = within
        self._message = message

    def holds(self, value: object) -> bool:
        """Whether `value` (what the predicate returned, or the exception it raised) ends the
        wait; once the deadline has passed, the test fails naming the last value."""
        if value and not isinstance(value, Exception):
            return True
        if time.monotonic() >= self._deadline:
            raise AssertionError(
                f"{self._message} (after {self._within:.1f}s; last value: {value!r})"
            )
        return False


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
    attempts = _Attempts(timeout, message)
    while True:
        try:
            value: T | Exception = predicate()
        except Exception as exc:  # the condition may legitimately fail until it holds
            value = exc
        if attempts.holds(value):
            return value  # type: ignore[return-value]
        time.sleep(interval)


async def poll(
    predicate: Callable[[], T | Awaitable[T]], within: float = 10.0, message: str = "condition"
) -> T:
    """`wait_until` for async tests: poll ``predicate`` (sync or async) on the running loop
    until it is truthy, or fail after ``within`` seconds with the last value it gave."""
    attempts = _Attempts(within, f"{message} not met")
    while True:
        try:
            result = predicate()
            value: T | Exception = await result if inspect.isawaitable(result) else result  # type: ignore[assignment]
        except Exception as exc:  # the condition may legitimately fail until it holds
            value = exc
        if attempts.holds(value):
            return value  # type: ignore[return-value]
        await asyncio.sleep(0.05)
