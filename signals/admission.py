"""From live telemetry to admission per service class (pure, no I/O).

Which routes use it
-------------------
Routes of a RoutingPolicy with ``serviceClasses``. Their requests are classified in Envoy
(header and tenant matches, else the route's class); this module decides, from the same
telemetry records the weight function reads, what share of each class Envoy admits. The
share travels in the route configuration (RDS), as the runtime fraction of a route entry
that sheds or diverts the rest, so a change reaches every Envoy of the fleet with the next
push and neither drains a connection nor rebuilds a cluster.

Pressure
--------
For the fresh records (younger than the pool's ``maxAge``) of the replicas in the route's
first tier, with ``S`` the policy's ``saturation`` bounds and ``T`` its TTFT bound
(``ServiceClasses.ttft_bound``: half the most important class's objective unless set)::

    pressure = max(mean(ttft) / T, mean(waiting) / S.queue, mean(kv_cache) / S.kv_cache,
                   mean(pending_tokens) / S.pending_tokens)

1.0 means saturated. The time to first token is the engines' own (vLLM's TTFT histogram,
between scrapes; idle replicas have none and do not count), against a bound taken from the
objective, so the pool counts as saturated where its most important class starts to miss.
Queues are no guide to that: in the service-class benchmark, long batch prompts prefilling in
the same steps as chat turns, and filling the KV cache so that chat histories were evicted,
multiplied the chat turns' TTFT by four to ten while the mean queue stayed under one request
per replica. Queue and KV-cache bounds still count, and catch the pools whose engines report
no TTFT.

The mean, not the busiest replica: one hot replica is the weights' and bounded load's job;
admission acts when the whole pool is short of room. ``S.busiest`` narrows the queue,
KV-cache and pending-token means to that percent of the replicas, the busiest by the
signal: with session affinity, bounded load lets a replica carry half again the mean, and
its sessions wait while the pool mean still has room. The TTFT stays the mean of every
replica that reports one: a replica's TTFT includes the long prompts' own prefill, so the
few replicas that took them read as saturated while the pool has room. No fresh record at
all gives no pressure, and everything is admitted (fail open, as stale weights go neutral).

Steps and hysteresis
--------------------
The decision is a level: how many steps of ``S.step`` percent are restricted, counted from
the least important class whose action is not ``admit``, then the next one up. Each round:

- pressure >= ``S.high``, at least ``S.shed_interval`` since the last change, and pressure
  not down by more than a tenth since that change: restrict at once the share of the
  class that the pressure implies, the excess over ``high`` as a share of the class
  (pressure 1.25 restricts a quarter more, 1.5 half, 2 or more the whole class), in whole
  steps and at least one, up to the end of the class being restricted (the next class up
  waits for the next round: its own requests may not be the excess);
- pressure <= ``S.low`` and at least ``S.recover_interval`` since the last change: one step
  back;
- otherwise nothing moves.

Restrict at once, give back slowly: a request admitted into an overload holds its replica
for as long as it runs (a long batch prompt, most of ten seconds in the service-class
benchmark), so shedding too little for a few seconds costs the interactive class for many
more; one step a second took four seconds to shed a class there. A draining queue needs no
more shedding, and the band between ``low`` and ``high`` and the longer recovery interval
keep a recovering pool from taking a class back, overloading again and shedding it again
(flapping).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from policies.models import Endpoint, Saturation, ServiceClass
from signals.telemetry import TelemetryRecord

FALLING = 0.9
"""Pressure below this share of its value at the last change counts as falling."""

Direction = Literal["restrict", "readmit"]


@dataclass(frozen=True, slots=True)
class Signal:
    """One saturation signal of a pool in one round: its mean over the replicas with fresh
    telemetry, and the bound at which it saturates the pool (``Saturation``)."""

    name: str
    """``queue``, ``kvCache``, ``pendingTokens`` (bound by the ``Saturation`` field of that
    name) or ``ttft`` (bound by ``ServiceClasses.ttft_bound``)."""
    mean: float
    bound: float

    @property
    def pressure(self) -> float:
        """The signal over its bound (1.0 = saturated)."""
        return round(self.mean / self.bound, 6)


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """What telemetry decided for one route; kept between rounds for hysteresis."""

    level: int = 0
    """Steps restricted, counted from the least important restricted class."""
    pressure: float | None = None
    """Pool pressure this round (1.0 = saturated); ``None`` without fresh telemetry."""
    changed_at: float = -math.inf
    """Wall-clock time of the last level change."""
    pressure_at_change: float = 0.0
    """Pressure when the level last changed, to tell a draining queue from a growing one."""
    admitted: Mapping[str, float] | None = None
    """Share of each class's requests Envoy admits, 0 to 1, by class name."""
    next_step_at: float = math.inf
    """When the level would move next if the pressure stayed as it is: the control plane
    rebuilds then even if no telemetry changes."""
    next_step: Direction | None = None
    """Which way that next step goes; None when the level holds."""
    # The two below are for operators and change nothing Envoy is sent: left out of equality,
    # so a route compiled from an equal decision is reused (``RouteMemo``).
    since: Mapping[str, float] | None = field(default=None, compare=False)
    """Wall-clock time each class's admitted share last changed, by class name
    (``-inf``: not since this control plane started deciding)."""
    signals: tuple[Signal, ...] = field(default=(), compare=False)
    """The signals the pressure was taken from this round (empty without fresh telemetry),
    so an operator sees which one is at its bound."""

    def share(self, service_class: str) -> float:
        """Admitted share of one class (1 for a class this decision does not restrict)."""
        return 1.0 if self.admitted is None else self.admitted.get(service_class, 1.0)


def pool_signals(
    endpoints: Sequence[Endpoint],
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float,
    max_age: float,
    saturation: Saturation,
    ttft_bound: float | None = None,
) -> tuple[Signal, ...]:
    """Each saturation signal of the replicas ``endpoints`` (see the module notes), with its
    bound; ``telemetry`` is keyed by ``Endpoint.key``. Empty when none of them has a fresh
    record."""
    fresh = [
        record
        for endpoint in endpoints
        if (record := telemetry.get(endpoint.key)) is not None and now - record.at <= max_age
    ]
    if not fresh:
        return ()

    def mean(values: list[float]) -> float:
        return busiest_mean(values, saturation.busiest)

    signals = [
        Signal("queue", mean([r.waiting or 0.0 for r in fresh]), saturation.queue),
        Signal("kvCache", mean([r.kv_cache or 0.0 for r in fresh]), saturation.kv_cache),
    ]
    ttfts = [r.ttft for r in fresh if r.ttft is not None]
    if ttft_bound is not None and ttfts:
        # Over every replica that reports one, even with ``busiest``: a replica's engine TTFT
        # includes the long prompts' own prefill, so the replicas that took them would read
        # as saturated with room all around (in the service-class benchmark the busiest
        # quarter's TTFT crossed half the objective at a fifth of the pool's batch slots).
        signals.append(Signal("ttft", statistics.fmean(ttfts), ttft_bound))
    if saturation.pending_tokens is not None:
        signals.append(
            Signal(
                "pendingTokens",
                mean([r.pending_tokens or 0.0 for r in fresh]),
                saturation.pending_tokens,
            )
        )
    return tuple(signals)


def busiest_mean(values: Sequence[float], busiest: int | None) -> float:
    """The mean of `values`, or with `busiest` (percent) of their largest share alone, at
    least one (``Saturation.busiest``)."""
    if busiest is None:
        return statistics.fmean(values)
    ordered = sorted(values, reverse=True)
    return statistics.fmean(ordered[: max(1, math.ceil(len(ordered) * busiest / 100 - 1e-9))])


def pressure_of(signals: Sequence[Signal]) -> float | None:
    """The pool's pressure: its largest signal over its bound; None without signals."""
    return max((signal.pressure for signal in signals), default=None)


def pool_pressure(
    endpoints: Sequence[Endpoint], telemetry: Mapping[str, TelemetryRecord], **options: Any
) -> float | None:
    """The pressure of the replicas ``endpoints``: the largest of ``pool_signals`` (same
    arguments) over its bound. ``None`` when none of them has a fresh record. Without
    ``ttft_bound`` the time to first token does not count."""
    return pressure_of(pool_signals(endpoints, telemetry, **options))


def steps_per_class(saturation: Saturation) -> int:
    """Steps that take one class from fully admitted to fully restricted."""
    return math.ceil(100 / saturation.step)


def decide(
    previous: AdmissionDecision | None,
    pressure: float | None,
    classes: Sequence[ServiceClass],
    *,
    now: float,
    saturation: Saturation,
    signals: tuple[Signal, ...] = (),
) -> AdmissionDecision:
    """This round's decision for one route, from the last one and the pool's pressure
    (``signals``, what the pressure was taken from, are kept on the decision for operators)."""
    before = previous or AdmissionDecision()
    restricted = [c for c in reversed(classes) if c.when_saturated != "admit"]
    top = len(restricted) * steps_per_class(saturation)
    step = step_level(before, pressure, top, now=now, saturation=saturation)
    level = step.level
    admitted = admitted_shares(classes, level, saturation)
    before_admitted, before_since = before.admitted or {}, before.since or {}
    class_since = {
        name: now if before_admitted.get(name, 1.0) != share else before_since.get(name, -math.inf)
        for name, share in admitted.items()
    }
    return AdmissionDecision(
        level=level,
        pressure=pressure,
        changed_at=step.changed_at,
        pressure_at_change=step.pressure_at_change,
        admitted=admitted,
        next_step_at=step.next_step_at,
        next_step=step.next_step,
        since=class_since,
        signals=signals,
    )


@dataclass(frozen=True, slots=True)
class LevelStep:
    """One round of a level's hysteresis (``step_level``)."""

    level: int
    changed_at: float
    """Wall-clock time of the last level change (this round's, if it moved)."""
    pressure_at_change: float
    next_step_at: float
    """When the level would move next at an unchanged pressure; ``inf`` when it holds."""
    next_step: Direction | None


def _one_step(pressure: float) -> int:
    return 1


def step_level(
    before: AdmissionDecision,
    pressure: float | None,
    top: int,
    *,
    now: float,
    saturation: Saturation,
    give_back: Callable[[float], int] = _one_step,
) -> LevelStep:
    """The hysteresis that admission and overflow (``signals.overflow``) both hold their
    level with (the module notes): restrict at once by ``restrict_steps`` at or above
    ``high`` unless the pressure is falling, give back ``give_back(pressure)`` steps at or
    below ``low`` (one for admission), each no sooner than its interval after the last
    change, nothing in the band; no pressure (no fresh telemetry) returns to zero. The
    level stays within 0 and `top`."""
    level, changed_at, at_change = before.level, before.changed_at, before.pressure_at_change
    since = now - changed_at
    if pressure is None:
        target = 0
    elif (
        pressure >= saturation.high
        and since >= saturation.shed_interval
        and pressure >= FALLING * at_change
    ):
        target = level + restrict_steps(level, pressure, saturation)
    elif pressure <= saturation.low and since >= saturation.recover_interval:
        target = level - give_back(pressure)
    else:
        target = level
    target = max(0, min(top, target))
    if target != level:
        level, changed_at, at_change = target, now, pressure or 0.0
    next_step_at = math.inf
    next_step: Direction | None = None
    if pressure is not None:
        if pressure >= saturation.high and level < top and pressure >= FALLING * at_change:
            next_step_at, next_step = changed_at + saturation.shed_interval, "restrict"
        elif pressure <= saturation.low and level > 0:
            next_step_at, next_step = changed_at + saturation.recover_interval, "readmit"
    return LevelStep(level, changed_at, at_change, next_step_at, next_step)


def restrict_steps(level: int, pressure: float, saturation: Saturation) -> int:
    """Steps to restrict at once from `level` at `pressure` (at or above ``high``): the
    excess over ``high``, as a share of a class, in whole steps and at least one, and never
    past the end of the class that is being restricted (see the module notes)."""
    per_class = steps_per_class(saturation)
    excess = pressure / saturation.high - 1.0
    # A hair below a whole step still takes it: 1.5 is two steps of 25, not three.
    wanted = max(1, math.ceil(excess * per_class - 1e-9))
    class_end = (level // per_class + 1) * per_class
    return min(wanted, class_end - level)


def admitted_shares(
    classes: Sequence[ServiceClass], level: int, saturation: Saturation
) -> dict[str, float]:
    """The admitted share of every class at ``level``: steps are taken from the least
    important restricted class first, ``saturation.step`` percent at a time."""
    per_class = steps_per_class(saturation)
    remaining = level
    out = {c.name: 1.0 for c in classes}
    for service_class in reversed(classes):
        if service_class.when_saturated == "admit" or remaining <= 0:
            continue
        taken = min(remaining, per_class)
        remaining -= taken
        out[service_class.name] = round(max(0.0, 1.0 - taken * saturation.step / 100), 6)
    return out


__all__ = [
    "AdmissionDecision",
    "Direction",
    "LevelStep",
    "Signal",
    "admitted_shares",
    "busiest_mean",
    "decide",
    "pool_pressure",
    "pool_signals",
    "pressure_of",
    "restrict_steps",
    "step_level",
    "steps_per_class",
]
