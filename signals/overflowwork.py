"""Overflow by arrivals in one unit of work (pure, no I/O): what ``signals.overflowff``
counts its demand and capacity in where the route's responses carry an OpenAI ``usage``.

Capacity and demand in one unit of work
---------------------------------------
Requests per second are not one unit when the kinds differ: with requests without a
session sent to the paid pools first, the owned replicas serve conversations alone at a
peak, and a conversation (long answers, a history to prefill on a miss) completes fewer a
second than the mixed load. Read replica by replica in requests, the capacity measured
2.5-3.7/s where the whole pool served 4.8/s at the mixed load, and divided into a demand of
every kind it sent too much to paid (0.95x the static split's spend in the cost benchmark).

So where the route's responses carry an OpenAI ``usage`` (the accounting filter's, read from
the listener's usage log: ``xdsserver.work``), demand and capacity are counted in the work
the owned replicas compute: output tokens plus uncached prompt tokens at a weight of an
output token (``Work``). In a full batch a replica's time goes to decode steps, one
token per sequence per step, and to prefilling what its cache does not hold; the weight is
what a prefilled token costs against a decoded one (the simulated engine: 1/4000 s a prompt
token, 23 ms a step of 8 sequences, 2.9 ms an output token: 0.086; on a GPU prefill is
compute-bound at thousands of tokens a second and decode at a full batch memory-bound, the
same order). Counting prompt tokens at par with output tokens would make the prefill four
fifths of the work in that benchmark where it takes about a third of the engines' time.
The ratio grows with the batch, as a fuller step makes each output token cheaper: the same
engine at 32 sequences is at 0.24 (33 ms a step of 32), and there the constant undercounts
the long prompts' work, reads the capacity high and sends less than the excess to paid
(docs/cost-overflow.md, "Measured at a batch of 32"). So the weight is the route's
``overflow.prefillWeight`` where set, else learned from the owned engines' own counters
while busy (``signals.prefillfit``), ``PREFILL_WEIGHT`` until the fit can say; the books
keep tokens (``Work``, ``KindWork``) and the weight is applied at the decision.

- **Demand** is the arrival rate times the mean work of a request of each kind over the
  last ``ARRIVAL_WINDOW`` (``KindWork``: every pool's responses, the kind from the route
  entry that took the request, with or without a session): rate x (p x plain work + (1 - p)
  x conversation work), p the share of requests without a session.
- **Capacity** is the work per second the owned replicas compute while full, read replica
  by replica (``ReplicaLoad``, ``engine_work``): the work its engine computed a second
  between the last two telemetry records kvpilot read, the output tokens it made plus the
  prompt tokens it prefilled at the weight, both from its own counters over the
  same time (``output_tokens_total``, ``prefilled_tokens_total``). An engine without a
  prefill count: its output tokens times the work per output token of the responses it
  served over the long window (``computed_rate``; without totals, the record's own
  ``output_tokens_per_second``), which a mix that moves at a peak biases. A replica's
  rate counts once it has been full for ``FULL_SCRAPES`` scrapes in a row, each scrape
  once (``full_scrapes``): the replicas that count give a sample, their rates over their
  slots (``rate_sample``), averaged in at ``RATE_WEIGHT`` from the prior
  (below), never taken outright. One replica full at a low load, or a scrape that held a
  long prefill's step, read the pool at 400-520 work/s where it computes some 1,500, and
  a first sample taken outright sent two thirds of the requests to paid at 100% of
  capacity. The scrape's own ``prefill_per_token`` is not the ratio: it counts a
  prompt when the engine admits it, not as it prefills, so a scrape that admitted a long
  prompt and decoded little read the pool at 7,000 work/s where it computed some 1,500.
  Nor is running over the mean time per output token the output rate: sequences still in
  their prefill run without making tokens, and steps without a decoding sequence are in no
  token's time; it read 1,700-2,200 work/s there. Counted from the responses' usage
  instead (the work each brought when it ended, ``work_sample``: each replica full for a
  request's time and then ``SAMPLE_WINDOW``), the first run of the cost benchmark read
  945-1,390 work/s where the pool computed about 1,480 when all were full: a replica stays
  full for that long with a paid share in force when its requests are long, and those end,
  and count, late. The responses' usage is the sample only for replicas whose telemetry has
  no token timings. Held per slot; before any sample, the prior in requests
  (``signals.overflowff``), which is also where the first sample is averaged in from. What
  the owned replicas completed over the long window, in work, bounds it from below.
- **The share** is of the demand's work: the paid pools take what the owned replicas cannot
  compute, requests without a session first, as many of them as carry that work (the plain
  share of ``kind_shares`` is then the share of the work without a session). For status and
  the drain, the capacity is shown in requests at the current mix (capacity's work over a
  request's mean work).

Without usage (a backend that sends none, fewer than ``MIN_WORK_REQUESTS`` responses in the
window) the unit is requests (``signals.overflowff``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

FULL = 0.95
"""Mean running / batch size at or above which the owned replicas' batches count as full."""
SAMPLE_WINDOW = 5.0
"""Seconds the batches must have been full, and the window completions are counted over,
for a capacity sample: at 4 completions a second, 20 of them."""

PREFILL_WEIGHT = 0.1
"""What an uncached prompt token counts against an output token in overflow's unit of work
until the engines' own ratio is learned (``signals.prefillfit``; module docstring: the
simulated engine's ratio is 0.086 at batches of 8, 0.24 at 32)."""
RATE_WEIGHT = 0.2
"""Weight of a round's sample of the full replicas' computed rates (``rate_sample``) against
the held one: a scrape's second of steps is noisy (a long prefill's step is half a second),
so about five scrapes make the estimate."""
FULL_SCRAPES = 3
"""Scrapes in a row a replica must have been full at before its computed rate counts: the
first scrape of a full batch can hold the steps before it filled, or one long prefill."""
MIN_WORK_REQUESTS = 8
"""Responses with usage a route needs over the window before its demand and capacity are
counted in work; fewer: in requests."""


class Work(NamedTuple):
    """Tokens a replica computed, kept apart so that the weight can be applied when the
    decision is made (``signals.prefillfit`` learns it while the tokens are counted)."""

    output: float
    """Output tokens (a rate where the book gives rates)."""
    prefill: float
    """Uncached prompt tokens it prefilled."""

    @classmethod
    def of(cls, prompt: int, cached: int, completion: int) -> Work:
        """The tokens one response took its replica, from its ``usage``: its completion, and
        its prompt less what was cached (nothing below zero: a provider's rounding can
        report more cached than prompt)."""
        return cls(completion, max(0, prompt - cached))

    def at(self, weight: float) -> float:
        """The work these tokens are: output plus prefill at `weight` (``PREFILL_WEIGHT``
        until the engines' own is learned, ``signals.prefillfit``)."""
        return self.output + weight * self.prefill


@dataclass(frozen=True, slots=True)
class KindWork:
    """A route's responses over the last window, every pool's, by kind: how many and their
    tokens (output and uncached prompt), whose work ``Work.at`` weighs."""

    plain: int = 0
    plain_output: float = 0.0
    plain_prefill: float = 0.0
    sessions: int = 0
    session_output: float = 0.0
    session_prefill: float = 0.0

    @property
    def requests(self) -> int:
        return self.plain + self.sessions

    def plain_work(self, weight: float = PREFILL_WEIGHT) -> float:
        return self.plain_output + weight * self.plain_prefill

    def session_work(self, weight: float = PREFILL_WEIGHT) -> float:
        return self.session_output + weight * self.session_prefill

    def mean(self, weight: float = PREFILL_WEIGHT) -> float | None:
        """The mean work of a request at this mix of kinds, a prefilled token at `weight`
        (rate x mean is the demand's work: the kinds' rates times their own means); None
        below ``MIN_WORK_REQUESTS``."""
        total = self.plain_work(weight) + self.session_work(weight)
        if self.requests < MIN_WORK_REQUESTS or total <= 0:
            return None
        return total / self.requests

    def plain_work_share(self, weight: float = PREFILL_WEIGHT) -> float | None:
        """The share of the demand's work without a session: what sending every such request
        to paid takes off the owned replicas."""
        plain = self.plain_work(weight)
        total = plain + self.session_work(weight)
        return plain / total if total > 0 else None


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One owned replica as the capacity sample in work reads it: its fresh telemetry and
    the work its responses carried."""

    key: str
    slots: float
    """Its batch size (``max_running``)."""
    running: float
    """Its running sequences over its batch size."""
    work: float | None
    """The work it completed per second over the last ``SAMPLE_WINDOW``; None: none seen."""
    rate: float | None = None
    """The work it computed per second at its last scrape (``computed_rate``); None: its
    telemetry has no token timings, or it served no response with usage lately."""
    at: float | None = None
    """When its telemetry was scraped (the record's time); None: unknown, every round is
    then a new scrape."""
    total: float | None = None
    """The output tokens its engine had made by that scrape (``output_tokens_total``)."""
    per_output: float | None = None
    """The work per output token of the responses it served (``computed_rate``)."""
    prefilled: float | None = None
    """The prompt tokens its engine had prefilled by that scrape (``prefilled_tokens_total``)."""
    steps: float | None = None
    """The steps its engine had run by that scrape (``steps_total``); None: not exported."""
    engines: int = 1
    """Engines behind it (``TelemetryRecord.engines``): its steps are their sum, and
    ``slots`` their batches together."""


def computed_rate(
    output_tokens_per_second: float | None, work_per_output: float | None
) -> float | None:
    """Work per second an engine computes: the output tokens it made a second (its last
    scrape) times the work per output token of the responses it served (`work_per_output`:
    ``Work.at`` over completion tokens, their prefill included). None without either."""
    if output_tokens_per_second is None or not work_per_output:
        return None
    # A full engine that made no token between two scrapes was prefilling: a rate of
    # nothing that counts, or the samples would hold only the scrapes between prefills.
    return output_tokens_per_second * work_per_output


def rate_sample(replicas: Sequence[ReplicaLoad]) -> float | None:
    """Work per second per batch slot the replicas full at their last scrape computed
    (``ReplicaLoad.rate``), or None when none of them is full with a rate."""
    sampled = [r for r in replicas if r.running >= FULL and r.rate is not None and r.slots > 0]
    if not sampled:
        return None
    return sum(r.rate or 0.0 for r in sampled) / sum(r.slots for r in sampled)


Scrapes = Mapping[str, tuple[float, int, float | None, float | None]]
"""Replica key -> (the time of its last scrape read, scrapes in a row it was full at, its
engine's output tokens and prefilled prompt tokens by then): what ``full_scrapes`` carries
from round to round."""


def full_scrapes(
    replicas: Sequence[ReplicaLoad], before: Scrapes, now: float, weight: float = PREFILL_WEIGHT
) -> tuple[dict[str, tuple[float, int, float | None, float | None]], list[ReplicaLoad]]:
    """(``Scrapes`` this round, the replicas whose rate counts this round): those full at a
    scrape not read before and at ``FULL_SCRAPES`` in a row. A replica not full at its last
    scrape starts again.

    A counted replica's rate is the work its engine computed between the last two scrapes
    read, over the time between them (``engine_work``): its output tokens and the prompt
    tokens it prefilled, both from its own counters over the same interval. Without the
    prefill count, the output tokens times the work per output token of its responses
    (``ReplicaLoad.per_output``); without the totals, the scrape's own rate
    (``ReplicaLoad.rate``): the interval before a record, and a record is written when a
    count moves (a request admitted or finished), so those intervals are not a fair sample
    of the engine's time."""
    counts: dict[str, tuple[float, int, float | None, float | None]] = {}
    new: list[ReplicaLoad] = []
    for replica in replicas:
        if replica.running < FULL:
            continue
        at = now if replica.at is None else replica.at
        last, count, total, prefilled = before.get(replica.key, (-math.inf, 0, None, None))
        if at == last:
            counts[replica.key] = (last, count, total, prefilled)
            continue
        counts[replica.key] = (at, count + 1, replica.total, replica.prefilled)
        if count + 1 < FULL_SCRAPES:
            continue
        rate = engine_work(replica, total, prefilled, at - last, weight)
        if rate is not None:
            replica = replace(replica, rate=rate)
        new.append(replica)
    return counts, new


def engine_work(
    replica: ReplicaLoad,
    total: float | None,
    prefilled: float | None,
    seconds: float,
    weight: float = PREFILL_WEIGHT,
) -> float | None:
    """Work per second `replica`'s engine computed since the scrape that read `total` output
    tokens and `prefilled` prompt tokens, `seconds` before; None when its totals cannot say
    (missing, or lower: the engine restarted).

    Both terms come from the engine over the same interval. The responses' work per output
    token is an average over the long window, and the mix moves at a peak: with requests
    without a session sent to paid, the owned engines decode conversations with their
    histories cached, make more tokens a second, and each of those carries less prefill
    than the window's responses did. Their product read the pool at 1,750-1,940 work/s in
    the cost benchmark's peak, where it computes some 1,450, and cut the paid share when the
    queue was growing."""
    if replica.total is None or total is None or replica.total < total or seconds <= 0:
        return None
    made = replica.total - total
    if replica.prefilled is not None and prefilled is not None and replica.prefilled >= prefilled:
        return (made + weight * (replica.prefilled - prefilled)) / seconds
    if not replica.per_output:
        return None
    return made / seconds * replica.per_output


def settled(service_time: float | None) -> float:
    """Seconds a replica must have been full before its completions are a capacity sample:
    a request's time in the batch (every one it finishes was admitted while it was full;
    `service_time`, the replicas' mean, at least ``SAMPLE_WINDOW``), then the window its
    completions are counted over."""
    return max(SAMPLE_WINDOW, service_time or 0.0) + SAMPLE_WINDOW


def work_sample(
    replicas: Sequence[ReplicaLoad],
    full_since: Mapping[str, float],
    now: float,
    service_time: float | None = None,
) -> float | None:
    """Work per second per batch slot of the replicas full for ``settled`` seconds
    (`full_since`: since when each has been), or None when none has (or none completed
    any)."""
    wait = settled(service_time)
    sampled = [
        replica
        for replica in replicas
        if now - full_since.get(replica.key, math.inf) >= wait
        and replica.work
        and replica.slots > 0
    ]
    if not sampled:
        return None
    return sum(r.work or 0.0 for r in sampled) / sum(r.slots for r in sampled)


__all__ = [
    "FULL",
    "FULL_SCRAPES",
    "MIN_WORK_REQUESTS",
    "PREFILL_WEIGHT",
    "RATE_WEIGHT",
    "SAMPLE_WINDOW",
    "KindWork",
    "ReplicaLoad",
    "Scrapes",
    "Work",
    "computed_rate",
    "engine_work",
    "full_scrapes",
    "rate_sample",
    "settled",
    "work_sample",
]
