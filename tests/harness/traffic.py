"""Sending requests through Envoy and counting which replica answered: one after another,
from threads in the background while a test changes something, and the binomial bounds that
statistical assertions on the counts use."""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import httpx

from harness.builders import chat
from harness.wait import wait_until

CHAT = "/v1/chat/completions"


def answered_by(response: httpx.Response) -> str:
    """The replica that answered (`x-backend-id`), or `status-N` when Envoy itself answered."""
    return response.headers.get("x-backend-id", f"status-{response.status_code}")


def send(
    client: httpx.Client,
    url: str,
    count: int,
    *,
    headers: Mapping[str, str] | None = None,
    body: Mapping[str, Any] | None = None,
) -> list[tuple[int, str]]:
    """Send `count` chat requests one after another; (status, replica) of each."""
    out = []
    for _ in range(count):
        response = client.post(url, json=dict(body or chat()), headers=dict(headers or {}))
        out.append((response.status_code, answered_by(response)))
    return out


def served_by(url: str, count: int) -> collections.Counter[str]:
    """Which replica answered each of `count` chat requests (each with its own content) sent
    one after another on one connection."""
    with httpx.Client(timeout=10) as client:
        return collections.Counter(
            answered_by(client.post(url, json=chat(content=str(index)))) for index in range(count)
        )


def replicas_behind(port: int, count: int = 8) -> set[str]:
    """The replicas that answered `count` chat requests sent to the Envoy listener on `port`."""
    return set(served_by(f"http://127.0.0.1:{port}{CHAT}", count))


Record = tuple[float, str, int, str]
"""(wall-clock time it finished, session id or "", status, replica that answered)."""


class Traffic:
    """Chat requests sent back to back from threads, from `with` (or `start()`) until its end.

    Every finished request is kept in `records`, in order of completion; a request that got
    no HTTP answer (connection reset, timeout) counts as status 0 with the exception's name
    and message as replica, so a test can count every failure a user would have seen. With
    `sessions`, the requests carry `x-session-id` s0, s1, ... in turn; with
    `fresh_connections` each goes on a new connection (so a Service in front of several
    Envoys spreads them); `limit` bounds the requests of each worker and `pause` spaces them.
    """

    def __init__(
        self,
        url: str,
        *,
        workers: int = 1,
        pause: float = 0.0,
        sessions: int = 0,
        fresh_connections: bool = False,
        limit: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.url = url
        self.records: list[Record] = []
        self._pause = pause
        self._sessions = sessions
        self._limits = httpx.Limits(max_keepalive_connections=0) if fresh_connections else None
        self._limit = limit
        self._timeout = timeout
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        limits = self._limits or httpx.Limits()
        with httpx.Client(timeout=self._timeout, limits=limits) as client:
            sent = 0
            while not self._stop.is_set() and (self._limit is None or sent < self._limit):
                session = f"s{sent % self._sessions}" if self._sessions else ""
                headers = {"x-session-id": session} if session else {}
                sent += 1
                try:
                    response = client.post(self.url, json=chat(), headers=headers)
                    status, replica = response.status_code, answered_by(response)
                except httpx.HTTPError as exc:
                    status, replica = 0, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.records.append((time.time(), session, status, replica))
                if self._pause:
                    time.sleep(self._pause)

    @property
    def results(self) -> list[tuple[int, str]]:
        """(status, replica) of each finished request, in order of completion."""
        with self._lock:
            return [(status, replica) for _, _, status, replica in self.records]

    def finished(self) -> int:
        """How many requests have finished so far."""
        with self._lock:
            return len(self.records)

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Wait until `count` requests in all have finished."""
        wait_until(lambda: self.finished() >= count, timeout, message=f"{count} requests")

    def failed(self) -> list[tuple[int, str]]:
        """(status, replica) of every request that did not get a 200."""
        return [result for result in self.results if result[0] != 200]

    def between(self, start: float, end: float) -> list[Record]:
        """The records of requests that finished in [start, end) (wall-clock seconds)."""
        with self._lock:
            return [record for record in self.records if start <= record[0] < end]

    def latest_all_on(self, prefix: str, count: int = 20) -> bool:
        """The next `count` requests (finished after this call) all landed on replicas whose
        id starts with `prefix`-."""
        start = self.finished()
        self.wait_for(start + count)
        return all(replica.startswith(f"{prefix}-") for _, replica in self.results[start:])

    def start(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def __enter__(self) -> Traffic:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def binomial_bounds(n: int, p: float, alpha: float = 1e-6) -> tuple[int, int]:
    """The narrowest-ish [lo, hi] with P(X < lo) + P(X > hi) < alpha for X ~ Binomial(n, p):
    each tail gets alpha / 2."""
    # In log space: math.comb(n, k) overflows a float from n of about 1,030.
    log_p, log_q = math.log(p), math.log1p(-p)
    pmf = [
        math.exp(
            math.lgamma(n + 1)
            - math.lgamma(k + 1)
            - math.lgamma(n - k + 1)
            + k * log_p
            + (n - k) * log_q
        )
        for k in range(n + 1)
    ]
    lo, tail = 0, 0.0
    while tail + pmf[lo] < alpha / 2:
        tail += pmf[lo]
        lo += 1
    hi, tail = n, 0.0
    while tail + pmf[hi] < alpha / 2:
        tail += pmf[hi]
        hi -= 1
    return lo, hi
