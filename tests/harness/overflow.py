"""A route with overflow by arrivals compiled from a state written by hand: the owned pool of
`harness.builders.arrivals_overflow` full at a batch of 8, a demand, and what else a test
gives; and a prefill fit learned on an engine whose ratio is known."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from compiler.compile import PolicyState, compile_plan
from harness.builders import arrivals_overflow
from policies import parse_object
from signals.overflowff import ArrivalsDecision
from signals.overflowwork import KindWork
from signals.prefillfit import MIN_FIT_WINDOWS, PrefillFit
from signals.telemetry import TelemetryRecord


def compiled_arrivals(
    ports: Sequence[int],
    *,
    now: float,
    demand: float = 6.0,
    live: Mapping[str, Any] | None = None,
    **overflow: Any,
) -> ArrivalsDecision:
    """The arrivals decision of route ``main/chat`` compiled at `now`: its 4 s service time,
    60% of its starts with a session, `demand` requests a second; `live`: more of
    ``PolicyState``'s live fields; `overflow`: more of the route's overflow fields."""
    hosts = [f"127.0.0.1:{port}" for port in ports]
    objects = [parse_object(body) for body in arrivals_overflow(ports, **overflow)]
    state = PolicyState.from_objects(
        objects,
        telemetry={
            "owned": {host: TelemetryRecord(at=now - 1, running=8, max_running=8) for host in hosts}
        },
        now=now,
        arrivals={"default/main/chat": demand},
        service_times={host: 4.0 for host in hosts},
        session_shares={"main/chat": 0.6},
        **(live or {}),
    )
    decision = compile_plan(state).overflow["main/chat"].arrivals
    assert decision is not None
    return decision


KINDS = KindWork(
    plain=20,
    plain_output=20 * 100.0,
    plain_prefill=20 * 3000.0,
    sessions=20,
    session_output=20 * 300.0,
    session_prefill=20 * 100.0,
)
"""A route's responses: documents of 100 output tokens and 3,000 prefilled, conversation
turns of 300 and 100."""

OUTPUT_COST, PREFILL_COST = 33e-3 / 32, 1 / 4000
"""An engine at a full batch of 32: 33 ms a step, a quarter of a millisecond a prompt token."""
TRUE_WEIGHT = PREFILL_COST / OUTPUT_COST


def full_intervals(
    count: int, seed: int = 1, noise: float = 0.0
) -> list[tuple[float, float, float]]:
    """(seconds, output, prefilled) of `count` intervals of that engine kept full, its mix
    moving; `noise`: the seconds' relative spread."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prefill_share = rng.uniform(0.2, 0.7)  # of the engine's time
        seconds = rng.uniform(10, 14)
        output = seconds * (1 - prefill_share) / OUTPUT_COST
        prefilled = seconds * prefill_share / PREFILL_COST
        out.append((seconds * (1 + rng.gauss(0, noise)), output, prefilled))
    return out


def fit_of(intervals: list[tuple[float, float, float]]) -> PrefillFit:
    """The fit of these full intervals."""
    fit = PrefillFit()
    for seconds, output, prefilled in intervals:
        fit = fit.add(seconds, output, prefilled)
    return fit


def learned_fit(count: int = MIN_FIT_WINDOWS, seed: int = 1) -> PrefillFit:
    """A fit of `count` intervals of that engine (it can say its weight, ``TRUE_WEIGHT``,
    from ``MIN_FIT_WINDOWS`` on)."""
    return fit_of(full_intervals(count, seed))
