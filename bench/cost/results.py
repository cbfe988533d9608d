"""The cost benchmark's typed results: one policy's numbers over a run's measured window
(`CostSummary`). A run's JSON file holds them under these names, and the several-seed report
reads them back from there (`CostSummary.from_json`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.rig.jsonfields import known, without_none


@dataclass(frozen=True)
class CostCalibration:
    """The arrival rates that offer the owned replicas' whole capacity."""

    session_rate_at_capacity: float
    """New conversations per simulated second."""
    single_rate_at_capacity: float
    """Single requests per simulated second."""
    capacity: str = "perfect affinity at full batches"
    """How the capacity was estimated (an upper bound)."""


@dataclass(frozen=True)
class Dollars:
    """Dollars for the owned replicas and for the paid API."""

    owned: float
    paid: float


@dataclass(frozen=True)
class PhaseRow:
    """One measured phase: requests answered, the share the paid API answered, TTFT p99."""

    requests: int
    paid_share: float
    ttft_p99: float | None


@dataclass(frozen=True)
class FullRate:
    """Requests per second the owned replicas finished while all full, and over how long."""

    rate: float
    seconds: float


@dataclass(frozen=True)
class PaidDollars:
    """The paid pool's dollars over one replay, by kvpilot's spend and from the responses."""

    kvpilot: float
    responses: float


@dataclass(frozen=True)
class OwnedHourly:
    """What the owned pool costs per hour, by kvpilot's spend view and by the config."""

    kvpilot: float | None
    config: float


@dataclass(frozen=True)
class SpendCheck:
    """kvpilot's own spend over one replay beside the responses' usage at the same prices
    (``bench.cost.spend``): per pool, and every difference (none when they agree)."""

    kvpilot: dict[str, dict[str, Any]]
    """Pool -> requests, tokens and cost, as ``bench.cost.spend.PoolSpend.as_json``."""
    responses: dict[str, dict[str, Any]]
    differences: list[str]
    paid_dollars: PaidDollars
    owned_hourly: OwnedHourly

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SpendCheck:
        return cls(
            **known(cls, data, "paid_dollars", "owned_hourly"),
            paid_dollars=PaidDollars(**data["paid_dollars"]),
            owned_hourly=OwnedHourly(**data["owned_hourly"]),
        )


@dataclass(frozen=True, kw_only=True)
class CostSummary:
    """One policy's numbers over the measured window (requests sent after the ramp)."""

    requests: int
    ok: int
    errors: int
    paid_requests: int
    paid_conversation_turns: int
    conversation_turns: int
    paid_token_share: float
    dollars: Dollars
    """In the measured window."""
    dollars_per_1k: Dollars
    """Per 1,000 requests answered."""
    owned_utilization: float | None
    """The owned replicas' mean share of a full batch in flight."""
    idle_owned_dollars: float | None
    ttft_p50: float
    ttft_p99: float
    peak_ttft_p99: float
    goodput_per_s: float
    """Requests per second answered within the objective."""
    budget_overshoot: float | None
    """Always None: no pool has a budget yet."""
    phases: dict[str, PhaseRow] = field(default_factory=dict)
    owned_full: FullRate | None = None
    """How fast the owned replicas finished requests while every one of them had a full
    batch: their measured capacity (``bench.cost.floor.full_rate``); None when they never
    were all full for long enough (and in files of older runs)."""
    spend: SpendCheck | None = None
    """kvpilot's spend against the responses' usage (files of older runs have none)."""
    wall_seconds: float = 0.0
    timed_out: bool = False

    def to_json(self) -> dict[str, Any]:
        return without_none(asdict(self), "spend", "owned_full")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostSummary:
        """The numbers as a run's JSON file holds them (``results[policy]``)."""
        return cls(
            **known(cls, data, "dollars", "dollars_per_1k", "phases", "spend", "owned_full"),
            dollars=Dollars(**data["dollars"]),
            dollars_per_1k=Dollars(**data["dollars_per_1k"]),
            phases={name: PhaseRow(**row) for name, row in data.get("phases", {}).items()},
            spend=SpendCheck.from_json(data["spend"]) if "spend" in data else None,
            owned_full=FullRate(**data["owned_full"]) if "owned_full" in data else None,
        )


Results = Mapping[int, Mapping[str, CostSummary]]
"""Seed -> policy -> its numbers."""
