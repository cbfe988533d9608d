"""A run in phases on a fleet paced by the wall clock: what the service-class and the cost
benchmarks share (`bench.classes.config`, `bench.cost.config`).

Both offer a load that changes phase by phase (a ramp that is not measured, then the phases
their reports read), and both run their simulated replicas at the wall clock's pace with
full batches of a few sequences, so that an overload of the fleet is one its engines see
(full batches, then a queue) and not one its load generator fails to send.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import Field
from typing import Any, ClassVar, Protocol, TypeVar

from replicasim.simulator import SimConfig

PACED_AGENT_INTERVAL = 0.25
"""Simulated seconds between the telemetry agent's scrapes on a paced fleet."""


class Stage(Protocol):
    """A phase of a run: its name, its length in simulated seconds, and whether its requests
    count (the ramp's do not)."""

    @property
    def name(self) -> str: ...

    @property
    def duration(self) -> float: ...

    @property
    def measured(self) -> bool: ...


class Phased:
    """The phases' timeline, for a config with a ``phases`` field (a dataclass adds the
    field; this adds what follows from it)."""

    phases: Sequence[Stage]

    @property
    def ramp(self) -> float:
        """Simulated seconds at the start whose requests are not measured."""
        ramp = 0.0
        for phase in self.phases:
            if phase.measured:
                break
            ramp += phase.duration
        return ramp

    @property
    def duration(self) -> float:
        """Simulated seconds of arrivals, the ramp included; no turn is sent after it."""
        return sum(phase.duration for phase in self.phases)

    def window(self, name: str) -> tuple[float, float]:
        """(start, end) of the phase `name`, simulated seconds from the run's start."""
        start = 0.0
        for phase in self.phases:
            if phase.name == name:
                return start, start + phase.duration
            start += phase.duration
        raise KeyError(name)

    def phase_at(self, at: float) -> str | None:
        """The name of the phase that simulated second `at` falls in (None after the last)."""
        start = 0.0
        for phase in self.phases:
            if start <= at < start + phase.duration:
                return phase.name
            start += phase.duration
        return None


class FleetSettings(Protocol):
    """The fields of a benchmark's settings that `paced` sets
    (`bench.routing.sequential.RoutingConfig` has them)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def sim(self) -> SimConfig: ...

    @property
    def agent_interval(self) -> float: ...

    @property
    def capacity_batch(self) -> int | None: ...


Settings = TypeVar("Settings", bound=FleetSettings)


def paced(settings: Settings, batch: int, **sim: Any) -> Settings:
    """`settings` with its simulated replicas at the wall clock's pace, batches of `batch`
    sequences and capacity estimated at full batches, streams sending a chunk a second, and
    the agent scraping every `PACED_AGENT_INTERVAL`; `sim` sets more of the simulator.

    A fleet of 4 to 8 replicas at 130% and more is a hundred streams at once for one load
    generator on a busy 2-core machine: at the wall clock's pace (not faster) it keeps up,
    and with TTFT taken as the engines timed it, a generator that falls behind delays
    arrivals without adding to the times measured. With capacity taken at full batches, an
    overload is more than the engines can serve."""
    engine = dataclasses.replace(
        settings.sim, time_scale=1.0, stream_interval=1.0, max_batch=batch, **sim
    )
    return dataclasses.replace(
        settings, sim=engine, agent_interval=PACED_AGENT_INTERVAL, capacity_batch=batch
    )
