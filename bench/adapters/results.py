"""The adapters benchmark's typed results: one policy's run (`AdapterRun`), its steady part
beside it. The JSON file names the fields in camelCase, as it always has."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Steady:
    """The requests sent after the warm-up, and the adapter loads since then."""

    requests: int
    ttft_p50: float | None
    ttft_p99: float | None
    loads: float
    loads_per_1000: float


@dataclass(frozen=True, kw_only=True)
class AdapterRun:
    """Every number of one policy's run."""

    requests: int
    errors: int
    ttft_p50: float | None
    ttft_p99: float | None
    adapter_loads: float
    """Adapter loads over every replica during the run."""
    loads_per_1000: float
    steady: Steady | None = None
    """None in files of runs from before the steady part was kept."""
    loads_by_replica: dict[str, float] = field(default_factory=dict)
    served_by_replica: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    """Wall-clock seconds of the replay."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests": self.requests,
            "errors": self.errors,
            "ttftP50": self.ttft_p50,
            "ttftP99": self.ttft_p99,
            "adapterLoads": self.adapter_loads,
            "loadsPer1000": self.loads_per_1000,
        }
        if self.steady is not None:
            out |= {
                "steadyRequests": self.steady.requests,
                "steadyTtftP50": self.steady.ttft_p50,
                "steadyTtftP99": self.steady.ttft_p99,
                "steadyLoads": self.steady.loads,
                "steadyLoadsPer1000": self.steady.loads_per_1000,
            }
        return out | {
            "loadsByReplica": self.loads_by_replica,
            "servedByReplica": self.served_by_replica,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AdapterRun:
        """A policy's entry of the JSON file (``results[policy]``)."""
        steady = (
            Steady(
                requests=data["steadyRequests"],
                ttft_p50=data.get("steadyTtftP50"),
                ttft_p99=data.get("steadyTtftP99"),
                loads=data["steadyLoads"],
                loads_per_1000=data["steadyLoadsPer1000"],
            )
            if "steadyTtftP99" in data
            else None
        )
        return cls(
            requests=data["requests"],
            errors=data["errors"],
            ttft_p50=data.get("ttftP50"),
            ttft_p99=data.get("ttftP99"),
            adapter_loads=data["adapterLoads"],
            loads_per_1000=data["loadsPer1000"],
            steady=steady,
            loads_by_replica=dict(data.get("loadsByReplica", {})),
            served_by_replica=dict(data.get("servedByReplica", {})),
            seconds=data.get("seconds", 0.0),
        )
