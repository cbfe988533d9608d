"""Scores of virtual models' requests, as Envoys report them over the access log service.

Each Envoy logs one entry per request that a virtual model's Lua scored
(``xdsserver.translate.listeners.score_log``), with the score, the target and why in dynamic
metadata. ``ScoreBook`` parses them (microseconds each), counts them for the metrics and hands
each to its listeners: the share controller (``controlplane.reconcile.difficulty``) learns the score
distribution from them. Nothing here is on a request's path: Envoy sends entries in batches
after the requests finished.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from xdsserver.translate.listeners import DIFFICULTY_METADATA


@dataclass(frozen=True, slots=True)
class ScoreReport:
    """One scored request."""

    key: str
    """The virtual model, ``policy/name``."""
    at: float
    """When the request started, wall-clock seconds."""
    score: float | None
    """None: the classifier gave no score in time and the fallback target took it."""
    target: str
    source: str
    """header, builtin, external or fallback."""
    forced: str
    """cap or floor when they overrode the scorer, else empty."""
    escalated: bool = False
    """The small model failed and the large one answered."""


def _text(fields: Any, name: str) -> str:
    value = fields.get(name)
    return value.string_value if value is not None else ""


def parse(entry: Any) -> ScoreReport | None:
    """The report in one ``HTTPAccessLogEntry``, or None when it carries none."""
    common = entry.common_properties
    metadata = common.metadata.filter_metadata
    if DIFFICULTY_METADATA not in metadata:
        return None
    fields = metadata[DIFFICULTY_METADATA].fields
    key = _text(fields, "virtual")
    if not key:
        return None
    raw = _text(fields, "score")
    try:
        score: float | None = float(raw) if raw else None
    except ValueError:
        score = None
    if score is not None and not math.isfinite(score):
        score = None
    start = common.start_time
    return ScoreReport(
        key=key,
        at=start.seconds + start.nanos / 1e9,
        score=score,
        target=_text(fields, "target"),
        source=_text(fields, "source"),
        forced=_text(fields, "forced"),
        escalated=entry.response.response_headers.get("x-kvpilot-escalated") == "true",
    )


@dataclass
class VirtualModelCounts:
    """One virtual model's requests by target, source and override, its escalations, and its
    scores in ten bins of 0.1."""

    targets: dict[str, int] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    forced: dict[str, int] = field(default_factory=dict)
    escalations: int = 0
    scores: list[int] = field(default_factory=lambda: [0] * 10)

    def add(self, report: ScoreReport) -> None:
        self.targets[report.target] = self.targets.get(report.target, 0) + 1
        self.sources[report.source] = self.sources.get(report.source, 0) + 1
        if report.forced:
            self.forced[report.forced] = self.forced.get(report.forced, 0) + 1
        self.escalations += report.escalated
        if report.score is not None:
            self.scores[min(9, int(report.score * 10))] += 1


class ScoreBook:
    """Counts reports per virtual model and passes each to its listeners."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.listeners: list[Callable[[ScoreReport], None]] = []
        self.requests = Counter(
            "kvpilot_virtual_model_requests",
            "Requests to a virtual model, by the target that took them, where the score came "
            "from (header, builtin, external, fallback) and whether the cap or the floor "
            "overrode it, as reported by Envoys.",
            ["virtual_model", "target", "source", "forced"],
            registry=registry,
        )
        self.scores = Histogram(
            "kvpilot_virtual_model_score",
            "Difficulty scores of a virtual model's requests (0 easy, 1 hard).",
            ["virtual_model"],
            buckets=[i / 10 for i in range(1, 11)],
            registry=registry,
        )
        self.escalations = Counter(
            "kvpilot_virtual_model_escalations",
            "Requests of a virtual model that the small model failed and the large one "
            "answered on retry.",
            ["virtual_model"],
            registry=registry,
        )
        self.ignored = 0
        """Entries of the score log that carried no report."""
        self.totals: dict[str, VirtualModelCounts] = {}
        """Per virtual model, what this replica was told since it started (the console)."""

    def observe(self, entry: Any) -> None:
        """Count one access log entry of the score log."""
        report = parse(entry)
        if report is None:
            self.ignored += 1
            return
        self.requests.labels(report.key, report.target, report.source, report.forced).inc()
        self.totals.setdefault(report.key, VirtualModelCounts()).add(report)
        if report.escalated:
            self.escalations.labels(report.key).inc()
        if report.score is not None:
            self.scores.labels(report.key).observe(report.score)
        for listener in self.listeners:
            listener(report)
