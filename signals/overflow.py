"""From live telemetry to the share of a route's requests that paid pools take (pure, no I/O).

Which routes use it
-------------------
Routes with ``overflow`` (``policies.models.Overflow``): their first tier is capacity already
paid for (owned replicas, an hourly price), the overflow pools are paid per token. Paid
capacity should take traffic only while the owned replicas are saturated or miss the
route's objective, and the cheapest paid pool first.

The loop
--------
Pressure is read from the first tier's telemetry as for admission (``signals.admission``):
the largest of mean batch fill over ``fill``, mean queue over ``queue`` and mean time to
first token over half the objective. The level (in steps of ``step`` percent) is
admission's level, with two pseudo-classes in place of service classes: requests without a
session header first, then (``conversations: last``) the conversations, whose KV cache the
replicas hold and a paid API does not. Restricting a pseudo-class here means sending that
share of it to the paid pools. The hysteresis is admission's (rise at once by the excess,
hold in the band between ``low`` and ``high``, move no sooner than the intervals), but at or
below ``low`` it gives back as many steps as the headroom under ``low`` allows, not one
(``give_back_steps``): a paid pool that keeps traffic the owned replicas could take back
costs money every second. The floor and cap (``minShare``, ``maxShare``) bound the shares after the loop, so
they hold whatever the telemetry says.

Feed-forward (``feedForward``, off by default): each round, on top of the loop's share of
plain requests, the replicas' excess demand (``excess_demand``) of the rest, times its
weight. It reacts within a telemetry scrape where the loop waits ``raiseInterval``, and
holds nothing between rounds.

Without a fresh record the level falls to zero: no telemetry buys no paid tokens (the
route's failover tiers and retries still cover replicas that are down).

Providers
---------
``provider_order`` sorts the overflow pools by price (``paid_price``: input plus output per
million tokens, from the pool's ``price`` once Pools carry one), listed order breaking ties. A provider that answered 429 rests until its ``Retry-After`` has passed
(``PolicyState.provider_backoff``, learned from Envoy's access log); overflow goes to the
first pool that is not resting, and to none when all are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache

from policies.models import (
    ClassObjective,
    Endpoint,
    Overflow,
    Pool,
    Saturation,
    ServiceClass,
)
from signals.admission import (
    AdmissionDecision,
    Signal,
    admitted_shares,
    pool_signals,
    pressure_of,
    step_level,
    steps_per_class,
)
from signals.overflowff import ArrivalsDecision, decide_arrivals, kind_shares
from signals.overflowwork import KindWork, ReplicaLoad
from signals.prefillfit import PrefillFit
from signals.prefillrecord import FitScope
from signals.saturation import batch_fill
from signals.telemetry import TelemetryRecord

PLAIN, SESSIONS, ALL = "requests", "sessions", "all"
"""The pseudo-classes of the level: requests without a session header, conversations, and
both together (``conversations: with``)."""


@dataclass(frozen=True, slots=True)
class OverflowDecision:
    """What telemetry decided for one route with overflow; kept between rounds."""

    level: AdmissionDecision = field(default_factory=AdmissionDecision)
    """The level and its hysteresis (``signals.admission``), over the pseudo-classes."""
    plain: float = 0.0
    """Share of the requests without a session header that go to the paid pools, 0 to 1."""
    sessions: float = 0.0
    """Share of the requests with a session header (conversations) that go there."""
    provider: str = ""
    """The paid pool that takes the overflow: the cheapest not resting; empty when none."""
    resting: Mapping[str, float] = field(default_factory=dict, compare=False)
    """Paid pools resting after a 429: pool -> wall-clock time they come back."""
    arrivals: ArrivalsDecision | None = field(default=None, compare=False)
    """With ``signal: arrivals``: the decision from the route's arrival rate
    (``signals.overflowff``), which set the shares; None for the fill loop."""

    @property
    def next_step_at(self) -> float:
        """When a rebuild is due although telemetry stays the same: the level's next step,
        a step back of the arrivals decision, or a resting provider's return."""
        step = self.arrivals.next_at if self.arrivals is not None else self.level.next_step_at
        return min(step, min(self.resting.values(), default=math.inf))

    @property
    def signal(self) -> str:
        """What set the shares: ``arrivals`` or ``fill``."""
        return "fill" if self.arrivals is None else "arrivals"

    @property
    def pressure(self) -> float | None:
        """The first tier's pressure this round (1.0 = saturated)."""
        return self.level.pressure


def paid_price(pool: Pool) -> tuple[str, float] | None:
    """A paid pool's price for the order overflow takes pools in: (currency, input plus
    output price per million tokens, ``Pool.spec.price``), or None when the pool has no
    per-token price (none at all, or only a price per replica-hour)."""
    price = pool.spec.price
    if price is None or price.input is None:
        return None
    return price.currency, float(price.input) + float(price.output or 0)


def provider_order(overflow: Overflow, pools: Mapping[str, Pool]) -> list[str]:
    """The overflow pools that exist, cheapest first (``paid_price``). Listed order breaks
    ties and places unpriced pools after priced ones; pools priced in different currencies
    are not compared (kvpilot never converts), so they keep the listed order."""
    present = [name for name in overflow.pools if name in pools]
    prices = {name: paid_price(pools[name]) for name in present}
    currencies = {price[0] for price in prices.values() if price is not None}
    if len(currencies) > 1:
        return present

    def key(name: str) -> tuple[bool, float, int]:
        price = prices[name]
        return price is None, price[1] if price is not None else 0.0, present.index(name)

    return sorted(present, key=key)


@cache
def _pseudo_classes(conversations: str) -> tuple[ServiceClass, ...]:
    """The classes admission's loop steps through, most important first (restricted last)."""
    names = (ALL,) if conversations == "with" else (SESSIONS, PLAIN)
    return tuple(
        ServiceClass(
            name=name,
            objective=ClassObjective(ttft=1.0),
            when_saturated="divert",
            divert_to="paid",
        )
        for name in names
    )


def saturation_of(overflow: Overflow) -> Saturation:
    """The overflow's bounds as admission's ``Saturation`` (its loop's parameters)."""
    return Saturation(
        ttft=overflow.ttft / 2 if overflow.ttft is not None else None,
        queue=overflow.queue,
        high=overflow.high,
        low=overflow.low,
        step=overflow.step,
        shed_interval=overflow.raise_interval,
        recover_interval=overflow.recover_interval,
    )


def overflow_signals(
    overflow: Overflow,
    endpoints: Sequence[Endpoint],
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float,
    max_age: float,
) -> tuple[Signal, ...]:
    """The first tier's signals: admission's (queue, KV cache, TTFT against half the
    objective) plus the mean batch fill against ``overflow.fill``."""
    saturation = saturation_of(overflow)
    signals = pool_signals(
        endpoints,
        telemetry,
        now=now,
        max_age=max_age,
        saturation=saturation,
        ttft_bound=saturation.ttft,
    )
    fill = batch_fill(endpoints, telemetry, now=now, max_age=max_age)
    if fill is not None:
        signals = (*signals, Signal("fill", fill, overflow.fill))
    return signals


def give_back_steps(pressure: float, saturation: Saturation) -> int:
    """Steps to give back at once at `pressure` (at or below ``low``): the headroom under
    ``low`` in steps, at least one. A step moves ``step`` percent of one kind of request,
    which is at most that share of the owned capacity while that kind's demand is within
    the capacity; so the replicas take back no more than brings them to ``low``."""
    headroom = (saturation.low - pressure) / saturation.high
    return max(1, math.floor(headroom * 100 / saturation.step + 1e-9))


def excess_demand(signals: Sequence[Signal]) -> float:
    """The share of the replicas' demand above their bound on batch fill: 1 - bound / fill
    (0 at or below the bound). Demand is requests in flight, running and waiting, against
    batch slots: by Little's law the arrival rate times the time a request holds a slot, so
    this is the part of the arrivals their capacity does not serve; the only measure of
    arrivals the loop has, and one that lags while the queue drains."""
    fill = next((signal for signal in signals if signal.name == "fill"), None)
    if fill is None or fill.mean <= fill.bound:
        return 0.0
    return 1.0 - fill.bound / fill.mean


def next_level(
    before: AdmissionDecision,
    pressure: float | None,
    classes: Sequence[ServiceClass],
    *,
    now: float,
    saturation: Saturation,
    signals: tuple[Signal, ...] = (),
) -> AdmissionDecision:
    """Admission's hysteresis (``signals.admission.step_level``), but giving back as many
    steps as the headroom under ``low`` allows (``give_back_steps``) instead of one: a paid
    pool that keeps traffic the owned replicas could take back costs money every second,
    where a shed class that comes back late costs nothing. The band and the intervals still
    hold."""
    top = len(classes) * steps_per_class(saturation)
    step = step_level(
        before,
        pressure,
        top,
        now=now,
        saturation=saturation,
        give_back=lambda at: give_back_steps(at, saturation),
    )
    return AdmissionDecision(
        level=step.level,
        pressure=pressure,
        changed_at=step.changed_at,
        pressure_at_change=step.pressure_at_change,
        admitted=admitted_shares(classes, step.level, saturation),
        next_step_at=step.next_step_at,
        signals=signals,
    )


def decide_overflow(
    previous: OverflowDecision | None,
    overflow: Overflow,
    signals: tuple[Signal, ...],
    providers: Sequence[str],
    resting: Mapping[str, float],
    *,
    now: float,
) -> OverflowDecision:
    """This round's decision for one route: the level from the pressure of `signals`, the
    shares it gives (bounded by the floor and the cap), and the first of `providers`
    (cheapest first) that is not resting (`resting`: pool -> until, wall clock)."""
    before = previous or OverflowDecision()
    classes = _pseudo_classes(overflow.conversations)
    level = next_level(
        before.level,
        pressure_of(signals),
        classes,
        now=now,
        saturation=saturation_of(overflow),
        signals=signals,
    )
    if overflow.conversations == "with":
        plain = sessions = 1.0 - level.share(ALL)
    else:
        plain, sessions = 1.0 - level.share(PLAIN), 1.0 - level.share(SESSIONS)
    extra = overflow.feed_forward * excess_demand(signals)
    if extra > 0:
        plain = plain + (1.0 - plain) * extra
        if overflow.conversations == "with":
            sessions = plain
    low, high = overflow.min_share / 100, overflow.max_share / 100
    still = {pool: until for pool, until in resting.items() if until > now and pool in providers}
    provider = next((pool for pool in providers if pool not in still), "")
    if not provider:
        plain = sessions = 0.0
    return OverflowDecision(
        level=level,
        plain=round(min(high, max(low, plain)), 6) if provider else 0.0,
        sessions=round(min(high, max(low, sessions)), 6) if provider else 0.0,
        provider=provider,
        resting=still,
    )


def decide_overflow_arrivals(
    previous: OverflowDecision | None,
    overflow: Overflow,
    signals: tuple[Signal, ...],
    providers: Sequence[str],
    resting: Mapping[str, float],
    *,
    demand: float | None,
    slots: float,
    running: float | None,
    completions: float | None,
    service_time: float | None,
    session_share: float | None,
    now: float,
    completed: float | None = None,
    queued: float | None = None,
    recent: float | None = None,
    replicas: Sequence[ReplicaLoad] = (),
    kinds: KindWork | None = None,
    completed_work: float | None = None,
    fit: PrefillFit | None = None,
    scope: FitScope | None = None,
) -> OverflowDecision:
    """This round's decision for a route with ``signal: arrivals``: the share of its demand
    above the owned replicas' capacity (``signals.overflowff``), split between plain
    requests and conversations, bounded by the floor and the cap, to the first of
    `providers` not resting. `signals` are the fill loop's, shown in status (its pressure)
    and read for the batch fill; `queued`: the requests waiting for a slot on the owned
    replicas, drained to the paid pools beyond what ``overflow.ttft`` allows; `recent`: the
    route's demand over the last few seconds alone, below which the share is not given back;
    `replicas`, `kinds`, `completed_work`: demand and capacity in work; `fit`, `scope`: the
    prefill fit to continue and what it is learned on
    (``signals.overflowff.decide_arrivals``)."""
    fill = next((signal.mean for signal in signals if signal.name == "fill"), None)
    before = previous.arrivals if previous is not None else None
    decision = decide_arrivals(
        before,
        demand=demand,
        slots=slots,
        running=running,
        fill=fill,
        completions=completions,
        service_time=service_time,
        completed=completed,
        session_share=session_share,
        queued=queued,
        recent=recent,
        objective=overflow.ttft,
        conversations=overflow.conversations,
        now=now,
        recover_interval=overflow.recover_interval,
        replicas=replicas,
        kinds=kinds,
        completed_work=completed_work,
        load=overflow.owned_share(),
        fixed_weight=overflow.prefill_weight,
        fit=fit,
        scope=scope,
    )
    plain, sessions = kind_shares(decision.paid, decision.plain_share, overflow.conversations)
    low, high = overflow.min_share / 100, overflow.max_share / 100
    still = {pool: until for pool, until in resting.items() if until > now and pool in providers}
    provider = next((pool for pool in providers if pool not in still), "")
    return OverflowDecision(
        level=AdmissionDecision(pressure=pressure_of(signals), signals=signals),
        plain=round(min(high, max(low, plain)), 6) if provider else 0.0,
        sessions=round(min(high, max(low, sessions)), 6) if provider else 0.0,
        provider=provider,
        resting=still,
        arrivals=decision,
    )


__all__ = [
    "ALL",
    "PLAIN",
    "SESSIONS",
    "OverflowDecision",
    "decide_overflow",
    "decide_overflow_arrivals",
    "excess_demand",
    "give_back_steps",
    "next_level",
    "overflow_signals",
    "paid_price",
    "provider_order",
    "saturation_of",
]
