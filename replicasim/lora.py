"""LoRA adapters of a simulated replica: which are loaded, what loading one costs, and how
vLLM reports them.

vLLM holds at most ``--max-loras`` adapters at once; a request for another one waits while
the adapter is loaded (from disk or a hub: hundreds of milliseconds), evicting the least
recently used adapter that no request is using. The replica lists what it has loaded at
``/v1/models`` (each adapter with ``parent`` set to the base model) and names the adapters of
its running and waiting requests in ``vllm:lora_requests_info``, as vLLM does. Counting loads
is what lets a benchmark show what adapter-aware routing saves.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class UnknownAdapter(LookupError):
    """A model name that is neither the base model nor an adapter this replica can load."""


@dataclass
class LoraSlots:
    """The adapters one replica can load (its catalog) and those it holds now."""

    catalog: frozenset[str]
    """Adapter names this replica can load on demand."""
    max_loaded: int = 8
    """Adapters held at once (vLLM ``--max-loras``)."""
    load_time: float = 0.3
    """Seconds a load takes; requests for the adapter wait that long."""
    loaded: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Loaded adapters, least recently used first."""
    loading: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    in_use: Counter[str] = field(default_factory=Counter)
    """Requests running per adapter; an adapter in use is never evicted."""
    waiting: Counter[str] = field(default_factory=Counter)
    """Requests waiting per adapter (for its load or for a free slot)."""
    loads: int = 0
    """Adapters loaded since start (or the last reset), on demand or by ``load``."""
    changed_at: float = field(default_factory=time.time)
    """When the running or waiting sets last changed (the value of vLLM's info gauge)."""
    _freed: asyncio.Event | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError("max_loaded must be at least 1")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LoraSlots:
        """Slots from ``{"catalog": [names], "maxLoaded": 8, "loadTime": 0.3, "loaded":
        [names]}`` (``python -m replicasim --lora``); ``ValueError`` names the bad field."""
        unknown = sorted(set(config) - {"catalog", "maxLoaded", "loadTime", "loaded"})
        if unknown:
            raise ValueError(f"unknown LoRA setting {unknown[0]!r}")
        catalog = config.get("catalog", [])
        if not isinstance(catalog, list) or not all(isinstance(n, str) for n in catalog):
            raise ValueError("catalog must be a list of adapter names")
        slots = cls(
            catalog=frozenset(catalog),
            max_loaded=int(config.get("maxLoaded", 8)),
            load_time=float(config.get("loadTime", 0.3)),
        )
        slots.load(config.get("loaded", []))
        slots.loads = 0
        return slots

    def knows(self, name: str) -> bool:
        """True when ``name`` is an adapter this replica can serve."""
        return name in self.catalog or name in self.loaded

    async def acquire(self, name: str) -> bool:
        """Hold adapter ``name`` for one request, loading it first when needed (the request
        waits). True when this request waited for a load. ``UnknownAdapter`` for a name
        outside the catalog."""
        if not self.knows(name):
            raise UnknownAdapter(name)
        waited = False
        self._mark(self.waiting, name, +1)
        try:
            while name not in self.loaded:
                waited = True
                pending = self.loading.get(name)
                if pending is not None:
                    await asyncio.shield(pending)
                    continue
                if len(self.loaded) + len(self.loading) >= self.max_loaded and not self._evict():
                    # Every slot holds an adapter in use: wait for a request to finish.
                    self._freed = self._freed or asyncio.Event()
                    await self._freed.wait()
                    continue
                future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self.loading[name] = future
                try:
                    await asyncio.sleep(self.load_time)
                    self.loaded[name] = None
                    self.loads += 1
                finally:
                    del self.loading[name]
                    future.set_result(None)
        finally:
            self._mark(self.waiting, name, -1)
        self.loaded.move_to_end(name)
        self._mark(self.in_use, name, +1)
        return waited

    def release(self, name: str) -> None:
        """One request for ``name`` finished."""
        self._mark(self.in_use, name, -1)
        if self._freed is not None and not self.in_use[name]:
            self._freed.set()
            self._freed = None

    def _mark(self, counts: Counter[str], name: str, step: int) -> None:
        before = bool(counts[name])
        counts[name] += step
        if counts[name] <= 0:
            del counts[name]
        if before != bool(counts[name]):
            self.changed_at = time.time()

    def _evict(self) -> bool:
        """Unload the least recently used adapter that no request holds; False if none."""
        for name in self.loaded:
            if not self.in_use[name] and not self.waiting[name]:
                del self.loaded[name]
                return True
        return False

    def load(self, names: Iterable[str]) -> None:
        """Load adapters at once (an operator's load call), evicting idle ones for room;
        ``ValueError`` when one is unknown or no slot can be freed."""
        for name in names:
            if not self.knows(name):
                raise ValueError(f"adapter {name!r} is not in this replica's catalog")
            if name in self.loaded:
                self.loaded.move_to_end(name)
                continue
            if len(self.loaded) + len(self.loading) >= self.max_loaded and not self._evict():
                raise ValueError(f"no free adapter slot for {name!r}: all are in use")
            self.loaded[name] = None
            self.loads += 1

    def unload(self, names: Iterable[str]) -> None:
        """Unload adapters (vLLM's unload call); unknown or unloaded names are ignored."""
        for name in names:
            self.loaded.pop(name, None)

    def reset(self) -> None:
        """Unload everything not in use and zero the load counter."""
        for name in [n for n in self.loaded if not self.in_use[n]]:
            del self.loaded[name]
        self.loads = 0

    def models_entries(self, base: str) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the loaded adapters, as vLLM lists them."""
        return [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": f"/adapters/{name}",
                "parent": base,
            }
            for name in sorted(self.loaded)
        ]

    def metrics_lines(self) -> list[str]:
        """vLLM's ``vllm:lora_requests_info`` and the replica's load counter."""
        running = ",".join(sorted(self.in_use))
        waiting = ",".join(sorted(self.waiting))
        return [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
            f'vllm:lora_requests_info{{max_lora="{self.max_loaded}",'
            f'running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}} '
            f"{self.changed_at}",
            "# HELP kvpilot_sim_lora_loads_total Adapters loaded since start.",
            "# TYPE kvpilot_sim_lora_loads_total counter",
            f"kvpilot_sim_lora_loads_total {self.loads}",
            "# HELP kvpilot_sim_lora_loaded Adapters loaded now.",
            "# TYPE kvpilot_sim_lora_loaded gauge",
            f"kvpilot_sim_lora_loaded {len(self.loaded)}",
        ]
