"""Open-loop load for the regions benchmark: per region, Poisson arrivals at a rate that may
change at any time, each request streamed through that region's Envoy with the region named
in ``x-client-region`` (the simulated replicas add the inter-region round trip from it).

Every request is recorded: when it was sent, its time to first token, which replica
answered, and how it failed if it did. The run's phases are read out of these records.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import httpx

CLIENT_REGION_HEADER = "x-client-region"
"""The header the simulated replicas read (``replicasim.replica.CLIENT_REGION_HEADER``)."""


@dataclass
class Sent:
    """One request and what became of it."""

    fleet: str
    """The region whose Envoy (fleet) the request went through."""
    start: float
    """Seconds since the run started, when it was sent."""
    status: int = 0
    replica: str = ""
    ttft: float | None = None
    end: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def region(self) -> str:
        """The region of the replica that answered (replica ids are ``<region>-<n>``)."""
        return self.replica.rsplit("-", 1)[0] if self.replica else ""

    @property
    def crossed(self) -> bool:
        return bool(self.replica) and self.region != self.fleet

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class OpenLoop:
    """Poisson arrivals per region into that region's Envoy, at rates the run sets."""

    def __init__(
        self,
        urls: Mapping[str, str],
        *,
        model: str,
        prompt_words: int,
        max_tokens: int,
        seed: int = 1,
    ) -> None:
        self.urls = dict(urls)
        self.rates: dict[str, float] = dict.fromkeys(urls, 0.0)
        """Requests per second into each region's Envoy; changed by the run as it goes."""
        self.model = model
        self.prompt_words = prompt_words
        self.max_tokens = max_tokens
        self.records: list[Sent] = []
        self.started = time.monotonic()
        # One random stream per region: with a shared one, which region draws next depends on
        # the event loop's timing, and the same seed gave different arrivals from run to run.
        self._random = {fleet: random.Random(f"{seed}/{fleet}") for fleet in urls}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.started

    async def run(self) -> None:
        """Send until `stop()`; then wait for every request in flight."""
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=400)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
            arrivals = [asyncio.create_task(self._arrivals(client, f)) for f in self.urls]
            await self._stop.wait()
            for task in arrivals:
                task.cancel()
            await asyncio.gather(*arrivals, return_exceptions=True)
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    def stop(self) -> None:
        self._stop.set()

    async def _arrivals(self, client: httpx.AsyncClient, fleet: str) -> None:
        # Arrivals on an absolute schedule: a busy event loop that wakes late sends the
        # requests that are due at once instead of lowering the rate.
        due = time.monotonic()
        while True:
            rate = self.rates[fleet]
            if rate <= 0:
                await asyncio.sleep(0.05)
                due = time.monotonic()
                continue
            due += self._random[fleet].expovariate(rate)
            now = time.monotonic()
            if due < now - 1.0:
                due = now  # more than a second behind: drop the backlog, not a burst
            # Always yields, even when due: a loop that never awaits would starve every
            # request it starts.
            await asyncio.sleep(max(0.0, due - now))
            task = asyncio.create_task(self._one(client, fleet, len(self.records)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, client: httpx.AsyncClient, fleet: str, index: int) -> None:
        words = " ".join(f"w{(index * 7 + i) % 997}" for i in range(self.prompt_words))
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"request {index}: {words}"}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        sent = time.monotonic()
        record = Sent(fleet, sent - self.started)
        self.records.append(record)
        headers = {CLIENT_REGION_HEADER: fleet}
        try:
            async with client.stream("POST", self.urls[fleet], json=body, headers=headers) as r:
                record.status = r.status_code
                record.replica = r.headers.get("x-backend-id", "")
                if r.status_code != 200:
                    await r.aread()
                    record.error = f"HTTP {r.status_code}"
                    return
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if record.ttft is None and _has_content(line[6:]):
                        record.ttft = time.monotonic() - sent
                if not done:
                    record.error = "stream ended without [DONE]"
        except httpx.HTTPError as error:
            record.error = f"{type(error).__name__}: {error}"[:200]
        finally:
            record.end = time.monotonic() - self.started


def _has_content(data: str) -> bool:
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    return any(
        (choice.get("delta") or {}).get("content") or choice.get("text")
        for choice in chunk.get("choices") or []
    )


__all__ = ["CLIENT_REGION_HEADER", "OpenLoop", "Sent"]
