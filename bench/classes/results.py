"""The service-class benchmark's typed results: per policy, per class and per phase. The
JSON file holds them as `dataclasses.asdict` gives them, so its keys are these fields'
names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PhaseRow:
    """One class's requests that started in one measured phase."""

    requests: int
    shed: int
    ttft_p99: float | None


@dataclass(frozen=True)
class ClassRow:
    """One class's numbers in one policy's run (requests started in the ramp excluded)."""

    requests: int
    ok: int
    shed: int
    diverted: int
    errors: int
    error_kinds: list[str]
    ttft_p50: float | None
    ttft_p99: float | None
    client_ttft_p99: float | None
    met_objective: int
    goodput_per_s: float
    by_phase: dict[str, PhaseRow] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClassRow:
        """The row as `dataclasses.asdict` wrote it to the JSON file."""
        phases = data.get("by_phase", {})
        fields = {k: v for k, v in data.items() if k != "by_phase"}
        return cls(**fields, by_phase={name: PhaseRow(**row) for name, row in phases.items()})


@dataclass(frozen=True)
class PolicyRun:
    """One policy's run: `bench.classes.report.summarize`'s numbers, then what the run
    itself measured beside them (the engines' counters, the admission samples, ...)."""

    classes: dict[str, ClassRow]
    goodput_per_s: float
    recovery_s: float
    shed_in_calm_phase: int
    per_request: list[dict[str, Any]] = field(default_factory=list)
    """Every request's `RequestResult.to_json`, with its ``class``."""
    engines: dict[str, dict[str, float | None]] = field(default_factory=dict)
    timed_out: bool = False
    wall_seconds: float = 0.0
    admission: list[dict[str, float]] = field(default_factory=list)
    signals: dict[str, Any] = field(default_factory=dict)
    replica_metrics: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PolicyRun:
        """The run as `dataclasses.asdict` wrote it to the JSON file (``results[policy]``)."""
        classes = {name: ClassRow.from_json(row) for name, row in data["classes"].items()}
        return cls(**{**data, "classes": classes})
