"""The service-class benchmark's typed results: per policy, per class and per phase. The
JSON file holds them as `PolicyRun.to_json` gives them, so its keys are these fields'
names (every request with its ``class`` beside its fields)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.classes.config import class_of
from bench.rig.jsonfields import known
from bench.rig.loadgen import RequestResult


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
class SignalLead:
    """One pool signal during the run: its peak, and its correlation with the interactive
    TTFT p90 of the requests arriving that many simulated seconds later, by lag."""

    peak: float | None
    correlation_by_lag: dict[str, float | None]
    """By lag in seconds, written as ``f"{lag:g}"``."""
    best_lag: str | None


@dataclass(frozen=True)
class PolicyRun:
    """One policy's run: `bench.classes.report.summarize`'s numbers, then what the run
    itself measured beside them (the engines' counters, the admission samples, ...)."""

    classes: dict[str, ClassRow]
    goodput_per_s: float
    recovery_s: float
    shed_in_calm_phase: int
    per_request: list[RequestResult] = field(default_factory=list)
    """Every request (its class is `bench.classes.config.class_of`)."""
    engines: dict[str, dict[str, float | None]] = field(default_factory=dict)
    timed_out: bool = False
    wall_seconds: float = 0.0
    admission: list[dict[str, float]] = field(default_factory=list)
    signals: dict[str, SignalLead] = field(default_factory=dict)
    """`bench.classes.signals.lead_table` by signal (the affinity run's only)."""
    replica_metrics: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON file's ``results[policy]``: every field, each request with its class."""
        requests = [{**r.to_json(), "class": class_of(r)} for r in self.per_request]
        return asdict(self) | {"per_request": requests}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PolicyRun:
        """The run as `to_json` wrote it to the JSON file (``results[policy]``)."""
        classes = {name: ClassRow.from_json(row) for name, row in data["classes"].items()}
        return cls(
            **known(cls, data, "classes", "per_request", "signals"),
            classes=classes,
            per_request=[RequestResult.from_json(r) for r in data.get("per_request", [])],
            signals={k: SignalLead(**v) for k, v in data.get("signals", {}).items()},
        )
