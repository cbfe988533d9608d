"""The routing benchmark's typed results: what the scenario suite measured for one policy in
one run (`Measured`, with its slowdown and weight sections), the workload it replayed
(`ScenarioWorkload`) and the calibration both modes share (`Calibration`).

The JSON files keep the keys these fields are named for, in the same order, and leave an
optional section out rather than writing null (as the files always did); ``from_json`` reads
files of older runs too: a missing optional key is None, an unknown one is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from bench.rig.jsonfields import known, without_none
from bench.rig.loadgen import RequestResult
from bench.rig.workload import WorkloadSummary

Timeline = list[tuple[float, list[float]]]
"""(simulated seconds into the run, each replica's weight by index), as kvpilot reported."""


@dataclass(frozen=True)
class Calibration:
    """The arrival rate a workload was generated at to offer its target load."""

    session_rate: float | None = None
    """New chat sessions per simulated second (chat and mix workloads)."""
    doc_rate: float | None = None
    """Document requests per simulated second (document workloads)."""
    estimated_cache_blind_load: float = 0.0
    """The load that rate offers, as a share of the cache-blind capacity it was sized for."""
    offered_load: float | None = None
    """The suite's: the same load as a share of the whole fleet's capacity."""

    @property
    def rate(self) -> float:
        return self.session_rate or self.doc_rate or 0.0

    def to_json(self) -> dict[str, Any]:
        return without_none(asdict(self), "session_rate", "doc_rate", "offered_load")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        return cls(**known(cls, data))


@dataclass(frozen=True)
class ScenarioWorkload:
    """One seed's workload of a suite scenario (the JSON file's ``workloads[key][i]``, the
    three parts side by side in one object)."""

    workload: WorkloadSummary
    calibration: Calibration
    oracle_hit_rate: float

    def to_json(self) -> dict[str, Any]:
        return {
            **self.workload.to_json(),
            **self.calibration.to_json(),
            "oracle_hit_rate": self.oracle_hit_rate,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScenarioWorkload:
        return cls(
            WorkloadSummary.from_json(data),
            Calibration.from_json(data),
            float(data["oracle_hit_rate"]),
        )


@dataclass(frozen=True)
class SlowPeriod:
    """Around a slowdown: the TTFT p99 before, during and after it, and the slowed replica's
    share of new sessions in each window."""

    ttft_p99_before: float | None
    ttft_p99_during: float | None
    ttft_p99_after: float | None
    """In the 10 s after the slowdown ended."""
    new_share_before: float | None
    new_share_first_5s: float | None
    new_share_after_5s: float | None
    """From 5 s after the slowdown began to its end."""
    new_share_recovered: float | None
    new_sessions_before: tuple[int, int] | None
    """(first turns the slowed replica answered, all first turns) before the slowdown: the
    counts behind the shares, to pool seeds by."""
    new_sessions_after_5s: tuple[int, int] | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SlowPeriod:
        values = known(cls, data)
        for name in ("new_sessions_before", "new_sessions_after_5s"):
            if values[name] is not None:
                mine, every = values[name]
                values[name] = (int(mine), int(every))
        return cls(**values)


@dataclass(frozen=True)
class AroundSlowdown:
    """How kvpilot's weight for a slowed replica moved: how long it took to fall after the
    slowdown and to come back after it, and its ring share during it over its share before
    (what a new session's chance to land there became)."""

    fell_after: float | None
    back_after: float | None
    ring_share_drop: float | None


@dataclass(frozen=True)
class WeightMoves:
    """How often kvpilot changed a replica's weight during the run (telemetry policies), and
    around a slowdown when the scenario has one."""

    weight_changes: int
    slowdown: AroundSlowdown | None = None

    def to_json(self) -> dict[str, Any]:
        """Flat, as the files have it: the slowdown's keys beside the count."""
        around = {} if self.slowdown is None else asdict(self.slowdown)
        return {"weight_changes": self.weight_changes, **around}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WeightMoves:
        names = [f.name for f in fields(AroundSlowdown)]
        slowdown = (
            AroundSlowdown(**{name: data.get(name) for name in names})
            if any(name in data for name in names)
            else None
        )
        return cls(int(data["weight_changes"]), slowdown)


_OPTIONAL = ("slow", "bound_changes", "weights", "weight_timeline")


@dataclass(frozen=True, kw_only=True)
class Measured:
    """The suite's numbers for one policy in one run, over the steady part of the run (times
    in simulated seconds, TTFTs as the engines measured them unless named ``client_``)."""

    requests: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    timed_out: bool
    hit_rate: float | None
    """Cached prompt tokens over prompt tokens of the measured requests."""
    ttft_p50: float | None
    ttft_p99: float | None
    latency_p99: float | None
    requests_per_s: float | None
    """Completed requests per second of the measured window."""
    makespan_s: float
    """The measured window."""
    load_max_over_mean: float | None
    served: dict[str, int]
    wall_seconds: float
    in_flight_mean: float | None
    engine_ttft_mean: float | None
    ttft_mean: float | None
    client_ttft_p50: float | None
    client_ttft_p99: float | None
    goodput_per_s: float | None
    goodput_share: float | None
    hit_vs_oracle: float | None
    oracle_hit_rate: float
    engine_hit_rate: float | None
    """The engines' prefix-cache counters over the whole run, ramp-up included."""
    prefill_share: float | None
    """The share of the engines' busy time that went to prompt tokens."""
    moved: int
    """Later turns of a session answered by another replica than the turn before."""
    moved_share: float
    slow: SlowPeriod | None = None
    """Only in a scenario with a slowdown."""
    per_request: list[RequestResult] = field(default_factory=list)
    """Every request; kept in the requests file, not the results file."""
    seed: int
    batch: int | None
    """The replicas' batch size (None in files of runs from before there were several)."""
    bound_changes: float | None = None
    """Capacity-bound policies: how often the bounded load changed during the replay."""
    weights: WeightMoves | None = None
    """Telemetry policies only."""
    weight_timeline: Timeline | None = None

    def to_json(self) -> dict[str, Any]:
        """The results file's entry (without `per_request`)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "per_request":
                continue
            if f.name == "slow" and value is not None:
                value = asdict(value)
            elif f.name == "weights" and value is not None:
                value = value.to_json()
            out[f.name] = value
        return without_none(out, *_OPTIONAL)

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], per_request: list[dict[str, Any]] | None = None
    ) -> Measured:
        """An entry of a results file, with its requests from the requests file if given."""
        slow, weights, timeline = data.get("slow"), data.get("weights"), data.get("weight_timeline")
        return cls(
            **known(cls, data, *_OPTIONAL, "per_request"),
            slow=None if slow is None else SlowPeriod.from_json(slow),
            bound_changes=data.get("bound_changes"),
            weights=None if weights is None else WeightMoves.from_json(weights),
            weight_timeline=None if timeline is None else [(t, list(w)) for t, w in timeline],
            per_request=[RequestResult.from_json(r) for r in per_request or ()],
        )


Runs = list[Measured]
"""One policy's measurements in one scenario, one per seed (in seed order)."""

SuiteResults = dict[str, dict[str, Runs]]
"""Runs by scenario key (``chat@8``), then by policy."""
