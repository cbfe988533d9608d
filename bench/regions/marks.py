"""When the things of one policy's run happened, for the report to cut its windows by."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Marks:
    """When things happened in one policy's run, in seconds since its load started."""

    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    killed: float = 0.0
    restarted: float = 0.0
    notice: float = 0.0
    learned: dict[str, float] = field(default_factory=dict)
    """Spot replica id -> when its registration turned draining in etcd (read through the
    API every 0.1 s: kvpilot learned of the notice no later)."""
    gone: float = 0.0
    capacity: float = 0.0
    """Requests per second one region serves at full batches."""
    service: float = 0.0
    """Seconds of one request served alone in its own region."""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """Every spill decision kvpilot's status showed, each time one changed: ``t`` (seconds
    since the load started), ``fleetRoute`` and the entry's inputs (arrivals, capacity and
    its parts, queue, drain, trim, batch fill) and ``keep``."""
    envoy_stats: list[dict[str, Any]] = field(default_factory=list)
    """At each phase's start and end: ``t``, ``phase``, ``edge`` (start or end), ``sent`` (per
    fleet, the requests the generator had sent by then) and ``stats`` (per region, that
    Envoy's request counters: downstream and upstream requests, pending, overflow, retries,
    circuit breakers), to tell requests that waited in or were refused by Envoy's
    connection pool from those the arrivals log counts."""


__all__ = ["Marks"]
