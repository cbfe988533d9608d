"""When a locality levels with the cluster's mean load rather than keeping ``LOAD`` of its
capacity (pure, no I/O; ``signals.spill`` applies it).

Feed-forward gives a locality ``LOAD`` (97%) of its capacity: right when every locality is
near its own, as in a regional overload whose total is about the cluster's capacity (only
the excess can go, and what crosses takes the other region's slots from its own traffic).
Not when the others have room: a locality that lost replicas in a spot wave and carries 85%
of what it has left queues (32 batch slots at 85%: a request in four waits for a slot, some
for seconds) while the next region's slots sit free.

So each round weighs the cluster's mean load M: every fleet's arrivals on every route over
the same replicas, over the capacity of all of them that serve, whichever locality
(``compiler.locality.mean_load``). A locality levels with M, that is it is given M of its
capacity (no less than ``queue_free_load`` of its slots: under that load what it would send
away is served at home at once) and sends what puts it level with the rest, when

- M is under ``BALANCE_ROOM``: the others have room (near the cluster's capacity levelling
  would send more than the excess only to move the queue from one region to the other);
- its own load A / C is over ``queue_free_load`` of its slots, the load at which a pooled
  queue of that many slots makes ``WAIT_CHANCE`` of the requests wait (Erlang C): 0.66 for
  32 slots, 0.75 for 64, 0.82 for 128. Under it the queue is short, and every request sent
  away pays the round trip;
- its own load is ``BALANCE_GAP`` or more above M (for two regions of one size: their
  loads 0.1 apart; in the regions benchmark's spot wave a locality 0.07 to 0.1 above M
  kept everything at 10 points, and one of its replicas queued requests for a second);
- the next priority has room: its batch fill is under ``LOW_FILL``. (Traffic that no
  arrivals log reports, from Envoys kvpilot does not configure, is not in M; their fill
  shows it.)

It goes on while M stays under ``BALANCE_ROOM`` plus ``BALANCE_HOLD``, its own load over
the queue-free load less ``BALANCE_HOLD`` and ``BALANCE_HOLD`` above M, and the next
priority does not queue (hysteresis: a Poisson rate over the arrival window moves by 10% and
more).
"""

from __future__ import annotations

from functools import lru_cache

BALANCE_ROOM = 0.85
"""The cluster's mean load under which the others have room (the regions benchmark's
overloads: 0.92 to 1.05; its spot wave: 0.6 to 0.78)."""
WAIT_CHANCE = 0.02
"""The share of requests that may wait for a slot in a locality that keeps its traffic: 2% of
one of two regions' requests is about 1% of them all, what a p99 holds."""
BALANCE_GAP = 0.05
"""How far a locality's own load must be above the mean before it levels with it."""
BALANCE_HOLD = 0.025
"""The hysteresis of levelling (module docstring)."""
DEFAULT_SLOTS = 64
"""The slots assumed when telemetry does not give them."""


def erlang_c(slots: int, offered: float) -> float:
    """The chance that a request waits in a pooled queue of `slots` servers offered
    `offered` erlangs (Erlang C); 1 at or over capacity."""
    if offered >= slots:
        return 1.0
    blocked = 1.0
    for k in range(1, slots + 1):
        blocked = offered * blocked / (k + offered * blocked)
    load = offered / slots
    return blocked / (1 - load + load * blocked)


@lru_cache(maxsize=256)
def queue_free_load(slots: int) -> float:
    """The highest load (a hundredth) at which `slots` pooled slots make at most
    ``WAIT_CHANCE`` of the requests wait."""
    slots = max(1, slots)
    return max(
        (
            step / 100
            for step in range(1, 100)
            if erlang_c(slots, step / 100 * slots) <= WAIT_CHANCE
        ),
        default=0.0,
    )


def levels(
    before: bool,
    *,
    own: float,
    mean: float | None,
    slots: int | None,
    next_room: bool,
    next_queues: bool,
) -> bool:
    """Whether a locality whose own load is `own` (arrivals over capacity), with `slots`
    batch slots, levels with the cluster's `mean` load this round; `before`: it did last
    round; `next_room`, `next_queues`: the priority that takes the spill has room (its
    batch fill known and under ``LOW_FILL``), queues (over ``HIGH_FILL``, or nothing serves
    there)."""
    if mean is None:
        return False
    start = queue_free_load(slots or DEFAULT_SLOTS)
    if before:
        return (
            mean <= BALANCE_ROOM + BALANCE_HOLD
            and own >= start - BALANCE_HOLD
            and own - mean >= BALANCE_HOLD
            and not next_queues
        )
    return mean <= BALANCE_ROOM and own >= start and own - mean >= BALANCE_GAP and next_room


__all__ = [
    "BALANCE_GAP",
    "BALANCE_HOLD",
    "BALANCE_ROOM",
    "WAIT_CHANCE",
    "erlang_c",
    "levels",
    "queue_free_load",
]
