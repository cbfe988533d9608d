"""The regions benchmark's typed results: one policy's run (`RegionsRun`) phase by phase.
The JSON file (and the report's JSON block) holds them under these names; ``overload``
keeps its fleets' entries beside ``expected_cross``, as it always has."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from bench.rig.jsonfields import known


@dataclass(frozen=True)
class Stats:
    """Some requests: how many, how many failed, the share answered in the other region,
    TTFT p50 and p99 (seconds)."""

    requests: int
    failed: int
    cross: float | None
    ttft_p50: float | None
    ttft_p99: float | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Stats:
        return cls(**known(cls, data))


@dataclass(frozen=True)
class Offered(Stats):
    """A fleet's requests in a window, with the rate the generator achieved and that rate
    as a share of a region's capacity (a busy machine may fall short)."""

    rate: float
    load: float

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Offered:
        return cls(**known(cls, data))


@dataclass(frozen=True)
class Served:
    """Region A's capacity as its replicas showed it during the overload (a shared machine
    slows the simulated replicas as a run goes on, so the capacity measured at the start can
    be high): what they completed per second, their mean in flight over their batch slots,
    and the excess that follows, (fleet A's rate - completed) / fleet A's rate."""

    completed_rps: float
    in_flight_over_slots: float | None
    excess: float | None


@dataclass(frozen=True)
class Overload:
    """The second half of the overload, per fleet, and the cross share expected of the
    overloaded fleet (only the excess: (load - 1) / load)."""

    fleets: dict[str, Offered]
    expected_cross: float
    served: Served | None = None
    """What region A's replicas served (files of older runs have none)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **{f: asdict(o) for f, o in self.fleets.items()},
            "expected_cross": self.expected_cross,
        }
        if self.served is not None:
            out["served"] = asdict(self.served)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Overload:
        fleets = {
            f: Offered.from_json(o)
            for f, o in data.items()
            if f not in ("expected_cross", "served")
        }
        served = Served(**data["served"]) if "served" in data else None
        return cls(fleets, float(data["expected_cross"]), served)


@dataclass(frozen=True)
class Down:
    """Fleet A's region killed: requests in flight then, what failed, and after."""

    in_flight_at_kill: int
    failed_in_flight: int
    failed_after_kill: int
    last_failure_after_kill_s: float
    fleet_a_after_kill: Stats
    answered_in_a_after_kill: int


@dataclass(frozen=True)
class LocalBin:
    """Two seconds of the recovery: fleet A's share answered in its own region."""

    t: float
    local: float | None
    n: int


@dataclass(frozen=True)
class Recovery:
    fleet_a_local_share: list[LocalBin]
    fleet_b: Stats


@dataclass(frozen=True)
class Drained:
    """A spot replica: when kvpilot learned of its notice, and the last request it was sent
    after that."""

    learned_after_notice_s: float
    last_start_after_learned_s: float | None


@dataclass(frozen=True)
class OverLimit:
    """The spot wave against its target's line, 1.5x the TTFT p99 before the notice: the
    requests during it over the line, those that crossed and those that stayed, and the most
    the p99 lets pass it (`allowed`: 1% of them). A request that crosses is over the line
    when its TTFT at once is over the line less the round trip, as `crossing_chance` of the
    requests before the notice were: so about `allowed / crossing_chance` requests, the
    `most_crossing` share of the wave's (all of them when no request before was that slow),
    may cross for the p99 to hold, even if none that stayed waited for a slot."""

    limit_s: float
    allowed: int
    crossed: int
    stayed: int
    crossing_chance: float
    most_crossing: float | None


@dataclass(frozen=True)
class Wave:
    """The spot wave: requests and failures over it, TTFT before and during, the drained
    replicas; the requests during it that stayed in their region and those that crossed
    (each crossing pays the round trip: with more than 1% of them crossing, the p99 during
    is about a TTFT at once plus the round trip, or more)."""

    failed: int
    requests: int
    before: Stats
    during: Stats
    drained: dict[str, Drained]
    stayed: Stats | None = None
    crossed: Stats | None = None
    over_limit: OverLimit | None = None


@dataclass(frozen=True)
class RegionsRun:
    """Every number of one policy's run."""

    service_s: float
    """One request's time in a full batch."""
    capacity_rps: float
    """A region's requests per second at full batches."""
    steady: dict[str, Offered]
    overload: Overload
    down: Down
    recovery: Recovery
    wave: Wave

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"overload": self.overload.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RegionsRun:
        down, recovery, wave = data["down"], data["recovery"], data["wave"]
        return cls(
            service_s=data["service_s"],
            capacity_rps=data["capacity_rps"],
            steady={f: Offered.from_json(o) for f, o in data["steady"].items()},
            overload=Overload.from_json(data["overload"]),
            down=Down(
                **known(Down, down, "fleet_a_after_kill"),
                fleet_a_after_kill=Stats.from_json(down["fleet_a_after_kill"]),
            ),
            recovery=Recovery(
                [LocalBin(**b) for b in recovery["fleet_a_local_share"]],
                Stats.from_json(recovery["fleet_b"]),
            ),
            wave=Wave(
                failed=wave["failed"],
                requests=wave["requests"],
                before=Stats.from_json(wave["before"]),
                during=Stats.from_json(wave["during"]),
                drained={rid: Drained(**d) for rid, d in wave["drained"].items()},
                stayed=Stats.from_json(wave["stayed"]) if wave.get("stayed") else None,
                crossed=Stats.from_json(wave["crossed"]) if wave.get("crossed") else None,
                over_limit=OverLimit(**wave["over_limit"]) if wave.get("over_limit") else None,
            ),
        )
