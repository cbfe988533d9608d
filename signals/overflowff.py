"""Overflow from the route's arrival rate against its owned replicas' capacity (pure, no I/O).

Which routes use it
-------------------
Routes with ``overflow.signal: arrivals`` (``policies.models.Overflow``). The fill loop
(``signals.overflow``) sees a rise of demand only as requests already admitted fill the
batches, seconds late. Here the route's Envoys report each request's start
(``xdsserver.arrivals``), so the paid share follows the demand itself:

    keep = trim x LOAD x capacity / demand        paid share = max(0, 1 - keep)

``demand`` is the route's requests per second, whichever pool took them (its own replicas,
its overflow aggregates, its paid pools: ``route_demand``, every kvpilot replica's through
``controlplane.arrivals``; each counted over the long window, or since the rate's last
change point, ``xdsserver.arrivals.change_point_rate``), or this replica's own rate over
the last few seconds when that is above it beyond noise (``blend_demand``): a rise counts
within seconds, a fall waits for the shared rate. ``LOAD`` (0.97, as spill's) leaves a little room so a
queue that formed while the share was found drains.

Capacity: measured while the batches are full
---------------------------------------------
What the owned replicas serve per second depends on how full they are: a request's time in
a full batch is longer than in a light one (its decode steps carry more sequences and the
prefill of every new arrival). A capacity taken at light load, batch slots over the service
time seen then, was 6.3/s in the cost benchmark where the replicas served 4.2-4.5/s at the
peak, and sent too little to the paid pool there. So the capacity is what the replicas
*completed* per second while their batches were full (mean running / batch size at least
``FULL``) for at least ``SAMPLE_WINDOW`` seconds, counted over those seconds: at a full
batch the completion rate is the capacity. It is kept per batch slot (a replica added or
lost moves it at once) and held between saturated periods, each new sample averaged in
(``SAMPLE_WEIGHT``). Before any saturated period the prior is conservative: batch slots over
the mean service time seen so far, times ``PRIOR_SHARE`` (0.7: the benchmark's full-batch
capacity was 0.67-0.71 of the light-load one). Whatever the estimate, what the replicas
completed over the last seconds, full or not, bounds it from below: a share that keeps the
batches from filling would otherwise keep a low prior from ever being measured.

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
the owned replicas compute: output tokens plus uncached prompt tokens at ``PREFILL_WEIGHT``
of an output token (``work_of``). In a full batch a replica's time goes to decode steps, one
token per sequence per step, and to prefilling what its cache does not hold; the weight is
what a prefilled token costs against a decoded one (the simulated engine: 1/4000 s a prompt
token, 23 ms a step of 8 sequences, 2.9 ms an output token: 0.086; on a GPU prefill is
compute-bound at thousands of tokens a second and decode at a full batch memory-bound, the
same order). Counting prompt tokens at par with output tokens would make the prefill four
fifths of the work in that benchmark where it takes about a third of the engines' time.

- **Demand** is the arrival rate times the mean work of a request of each kind over the
  last ``ARRIVAL_WINDOW`` (``KindWork``: every pool's responses, the kind from the route
  entry that took the request, with or without a session): rate x (p x plain work + (1 - p)
  x conversation work), p the share of requests without a session.
- **Capacity** is the work per second the owned replicas compute while full, read replica
  by replica (``ReplicaLoad``, ``computed_rate``): the output tokens the engine made a
  second between the agent's last two scrapes (``output_tokens_per_second``), times the
  work per output token of the responses it served over the long window (from their
  usage). Each round the replicas full at their last
  scrape give a sample, their rates over their slots (``rate_sample``), averaged in at
  ``RATE_WEIGHT``. The scrape's own ``prefill_per_token`` is not the ratio: it counts a
  prompt when the engine admits it, not as it prefills, so a scrape that admitted a long
  prompt and decoded little read the pool at 7,000 work/s where it computed some 1,500.
  Nor is running over the mean time per output token the output rate: sequences still in
  their prefill run without making tokens, and steps without a decoding sequence are in no
  token's time; it read 1,700-2,200 work/s there. Counted from the responses' usage instead (the work each brought when it
  ended, ``work_sample``: each replica full for a request's time and then
  ``SAMPLE_WINDOW``), the first run of the cost benchmark read 945-1,390 work/s where the
  pool computed about 1,480 when all were full: a replica stays full for that long with a
  paid share in force when its requests are long, and those end, and count, late. The
  responses' usage is the sample only for replicas whose telemetry has no token timings.
  Held per slot; before any sample, the prior in requests. What the owned replicas
  completed over the long window, in work, bounds it from below.
- **The share** is of the demand's work: the paid pools take what the owned replicas cannot
  compute, requests without a session first, as many of them as carry that work (the plain
  share of ``kind_shares`` is then the share of the work without a session). For status and
  the drain, the capacity is shown in requests at the current mix (capacity's work over a
  request's mean work).

Without usage (a backend that sends none, fewer than ``MIN_WORK_REQUESTS`` responses in the
window) the unit is requests, as above.

The trim, as spill's
--------------------
The batch fill ((running + waiting) / batch size) corrects the estimate rather than the
share (``signals.spill``'s constants): above ``HIGH_FILL`` while a paid share has been in
force for a ``DWELL`` (or a queue lasting ``LASTING`` seconds without one) and not draining,
``trim`` falls in proportion (``TARGET_FILL / fill``, at most to ``MAX_CUT`` of itself); below
``LOW_FILL`` with a paid share it rises by ``STEP``, but only while that share is what the
estimate asked for (room made by a drain or by a share held above the estimate is the
share's doing: in the cost benchmark it raised the trim from 0.97 to 1.46 over the peak
and sent 3% to paid at 140% of capacity); bounded by ``TRIM_RANGE``, changed at most once a
``DWELL``.

A queue beyond the objective, drained
-------------------------------------
The estimate keeps a queue from growing; it does not shrink one that formed while the share
was found (at a rise, or at a peak whose capacity read high), and on the way down that queue
is a wait every arrival pays. With a TTFT objective (``Overflow.ttft``) the owned replicas
may hold the queue a request can wait through within ``QUEUE_WAIT`` of it: capacity x
objective x 0.5 requests. What waits beyond that goes to the paid pools too, over
spill's ``DRAIN_S`` (``drain_rate``): the share rises by that rate over the demand (with
``conversations: last`` no further than the requests without a session reach). Without an
objective nothing is drained: chance alone (``4 x sqrt(slots)``, spill's bound) was never
reached in the cost benchmark, where 19 waiting at 5/s were already 4 s of a 1 s objective.

Hysteresis
----------
The share rises at once when the target is ``DEADBAND`` above it (demand that arrives now is
served now, by someone). It falls to the target, at most once per ``recoverInterval``
(``Overflow.recover_interval``), when the target is ``DEADBAND`` below it, or to nothing
when the target is nothing: a Poisson count over a few seconds does not move it back and
forth, and traffic returns to the owned replicas when demand falls. A fall goes no lower
than what the last few seconds' rate alone asks for when that rate is the higher: in a
rise the long window still holds the rate from before, and the cost benchmark's seed 3
gave its whole share back in the middle of one (demand read 3.5/s of some 5) and met the
peak with a queue. On the way down the recent rate is the lower one and changes nothing.

Kinds of request
----------------
The share is of the route's whole demand. With ``conversations: last`` the requests
without a session take it first: plain share = paid / p, sessions = (paid - p) / (1 - p),
where p is the share of the demand without a session, learned while nothing overflowed
(the starts on the route's own cluster against its affinity twin), 0.5 before that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from signals.spill import (
    DEADBAND,
    DRAIN_S,
    DWELL,
    HIGH_FILL,
    LASTING,
    LOAD,
    LOW_FILL,
    MAX_CUT,
    STEP,
    TARGET_FILL,
    TRIM_RANGE,
)

OVERFLOW_PARTS = ("/overflow/", "/provider/")
"""What follows a route cluster's name in the names of its overflow aggregates and paid
pools' clusters (``policies.names``): starts there are the route's demand too."""


RISE_SIGMAS = 2.0
"""The recent rate (the last ``RECENT_WINDOW`` seconds) replaces the long one when it is
above it by more than this many standard deviations of its own count: a rise shows within
seconds, the noise of a few seconds' count does not."""
RECENT_WINDOW = 4.0
"""Seconds of the recent rate (``xdsserver.arrivals.CHANGE_WINDOW``)."""


def blend_demand(long: float, recent: float | None) -> float:
    """The demand overflow reads: the long window's rate, or the recent one when it is
    above it beyond noise (``RISE_SIGMAS``). A fall waits for the long window (and the
    hysteresis), so the share is not given back on a quiet second."""
    if recent is None or recent <= long:
        return long
    expected = long * RECENT_WINDOW
    if (recent - long) * RECENT_WINDOW > RISE_SIGMAS * math.sqrt(max(expected, 1.0)):
        return recent
    return long


def route_of(cluster: str) -> str:
    """The route cluster (``policy/route``) that a route cluster, one of its overflow
    aggregates or one of its paid pools' clusters belongs to."""
    for part in OVERFLOW_PARTS:
        head, found, _ = cluster.partition(part)
        if found:
            return head
    return cluster


def route_demand(rates: Mapping[str, float], route: str) -> float:
    """A route's demand: the requests per second started on its own cluster (`route`,
    ``policy/route``) and on its overflow aggregates and paid pools' clusters, by every fleet,
    from ``fleet/cluster`` rates (``ArrivalBook.rates``, or every replica's through
    ``controlplane.arrivals``)."""
    total = 0.0
    for key, rate in rates.items():
        _, _, cluster = key.partition("/")
        if cluster == route or any(cluster.startswith(route + part) for part in OVERFLOW_PARTS):
            total += rate
    return round(total, 4)


FULL = 0.95
"""Mean running / batch size at or above which the owned replicas' batches count as full."""
SAMPLE_WINDOW = 5.0
"""Seconds the batches must have been full, and the window completions are counted over,
for a capacity sample: at 4 completions a second, 20 of them."""
SAMPLE_WEIGHT = 0.5
"""Weight of a new capacity sample against the held one."""
PRIOR_SHARE = 0.7
"""The prior capacity before any saturated period: this share of batch slots over the
mean service time seen so far (module docstring)."""
PLAIN_PRIOR = 0.5
"""Share of the demand without a session assumed before it was seen."""
QUEUE_WAIT = 0.5
"""Share of the route's TTFT objective (``Overflow.ttft``) a request may spend waiting for
a batch slot: the queue the owned replicas may hold is this much of the objective times
their capacity, the rest of the objective is left to the prefill (the fill loop's TTFT
signal bounds the engines' time to first token at half of it too)."""


PREFILL_WEIGHT = 0.1
"""What an uncached prompt token counts against an output token in overflow's unit of work
(module docstring: the simulated engine's ratio is 0.086)."""
RATE_WEIGHT = 0.2
"""Weight of a round's sample of the full replicas' computed rates (``rate_sample``) against
the held one: a scrape's second of steps is noisy (a long prefill's step is half a second),
so about five rounds make the estimate."""
MIN_WORK_REQUESTS = 8
"""Responses with usage a route needs over the window before its demand and capacity are
counted in work; fewer: in requests."""


def work_of(prompt: int, cached: int, completion: int) -> float:
    """The work one response took its replica: output tokens plus the uncached prompt
    tokens at ``PREFILL_WEIGHT``."""
    return completion + PREFILL_WEIGHT * max(0, prompt - cached)


@dataclass(frozen=True, slots=True)
class KindWork:
    """A route's responses over the last window, every pool's, by kind: how many and their
    work (``work_of``)."""

    plain: int = 0
    plain_work: float = 0.0
    sessions: int = 0
    session_work: float = 0.0

    @property
    def requests(self) -> int:
        return self.plain + self.sessions

    def mean(self) -> float | None:
        """The mean work of a request at this mix of kinds (rate x mean is the demand's
        work: the kinds' rates times their own means); None below ``MIN_WORK_REQUESTS``."""
        total = self.plain_work + self.session_work
        if self.requests < MIN_WORK_REQUESTS or total <= 0:
            return None
        return total / self.requests

    def plain_work_share(self) -> float | None:
        """The share of the demand's work without a session: what sending every such request
        to paid takes off the owned replicas."""
        total = self.plain_work + self.session_work
        return self.plain_work / total if total > 0 else None


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


def computed_rate(
    output_tokens_per_second: float | None, work_per_output: float | None
) -> float | None:
    """Work per second an engine computes: the output tokens it made a second (its last
    scrape) times the work per output token of the responses it served (`work_per_output`:
    ``work_of`` over completion tokens, their prefill included). None without either."""
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


@dataclass(frozen=True, slots=True)
class ArrivalsDecision:
    """One route's overflow by arrivals; kept between rounds."""

    paid: float = 0.0
    """Share of the route's demand sent to the paid pools, 0 to 1 (before the floor and
    cap of ``Overflow``)."""
    since: float = -math.inf
    """Wall-clock time of the last change of ``paid``."""
    demand: float | None = None
    """The route's requests per second this round; None: not reported yet."""
    capacity: float | None = None
    """The owned replicas' requests per second used this round; None: unknown."""
    measured: bool = False
    """``capacity`` comes from a saturated period (else from the prior)."""
    per_slot: float | None = None
    """Held capacity per batch slot, measured while the batches were full."""
    full_since: float = math.inf
    """Since when the batches have been full (infinite: they are not)."""
    work_per_slot: float | None = None
    """Held capacity in work per second per batch slot, measured replica by replica while
    full (``work_sample``)."""
    replicas_full_since: Mapping[str, float] = field(default_factory=dict)
    """Replica key -> since when its batch has been full (absent: it is not)."""
    work: float | None = None
    """The mean work of a request this round when demand and capacity are counted in work
    (``KindWork.mean``); None: in requests."""
    trim: float = 1.0
    """The fill's correction of the estimate (``TRIM_RANGE``)."""
    trim_since: float = -math.inf
    high_since: float = math.inf
    """Since when the fill has been above ``HIGH_FILL``."""
    step_fill: float | None = None
    """The fill at the last change of ``paid`` or ``trim``: a lower fill now is a queue
    draining."""
    plain_share: float | None = None
    """Share of the demand without a session, learned while nothing overflowed."""
    queued: float | None = field(default=None, compare=False)
    """Requests waiting for a batch slot on the owned replicas this round."""
    drain: float = field(default=0.0, compare=False)
    """Requests per second sent to the paid pools this round, beyond the excess demand, to
    drain a queue longer than the TTFT objective allows (``drain_rate``)."""
    fill: float | None = field(default=None, compare=False)
    target: float = field(default=0.0, compare=False)
    """The share the estimate asked for this round (``paid`` follows it with hysteresis)."""
    why: str = field(default="", compare=False)
    """In words, for status and logs."""
    recover_interval: float = field(default=5.0, compare=False)

    @property
    def next_at(self) -> float:
        """When a step back is due although nothing else triggers a rebuild."""
        if self.paid > 0 and self.target < self.paid:
            return self.since + self.recover_interval
        return math.inf


def capacity_of(
    per_slot: float | None, slots: float, service_time: float | None
) -> tuple[float | None, bool]:
    """(capacity in requests per second, measured): the held full-batch rate per slot times
    the slots, else the conservative prior, else None."""
    if slots <= 0:
        return None, False
    if per_slot is not None:
        return round(per_slot * slots, 4), True
    if service_time is not None and service_time > 0:
        return round(PRIOR_SHARE * slots / service_time, 4), False
    return None, False


def drain_rate(
    queued: float | None, capacity: float, objective: float | None
) -> tuple[float, float]:
    """(requests per second to send to the paid pools to drain the owned replicas' queue,
    the queue allowed): the queue beyond what a request may wait for a slot within the TTFT
    `objective` (``QUEUE_WAIT`` of it, at `capacity` requests per second), sent over
    ``DRAIN_S`` (as spill's drain). Nothing without an objective or a queue.

    A queue the peak left behind is a wait every later arrival pays until the replicas have
    served it; the estimate from demand and capacity keeps the queue from growing but does
    not shrink it, and the trim moves slowly (``DWELL``). Each request drained costs what a
    paid request costs, and each is one that would have missed the objective."""
    if objective is None or queued is None or capacity <= 0:
        return 0.0, math.inf
    allowed = capacity * objective * QUEUE_WAIT
    return round(max(0.0, queued - allowed) / DRAIN_S, 4), round(allowed, 4)


def kind_shares(paid: float, plain_share: float | None, conversations: str) -> tuple[float, float]:
    """(share of requests without a session, share of conversations) that send `paid` of
    the whole demand to the paid pools; plain requests first with ``conversations: last``."""
    if conversations == "with":
        return paid, paid
    p = PLAIN_PRIOR if plain_share is None else min(1.0, max(0.0, plain_share))
    if p <= 0:
        return (1.0 if paid > 0 else 0.0), paid
    plain = min(1.0, paid / p)
    sessions = max(0.0, (paid - p) / (1.0 - p)) if p < 1.0 else 0.0
    return round(plain, 6), round(min(1.0, sessions), 6)


def decide_arrivals(
    previous: ArrivalsDecision | None,
    *,
    demand: float | None,
    slots: float,
    running: float | None,
    fill: float | None,
    completions: float | None,
    service_time: float | None,
    completed: float | None = None,
    session_share: float | None = None,
    queued: float | None = None,
    objective: float | None = None,
    conversations: str = "last",
    recent: float | None = None,
    now: float,
    recover_interval: float = 5.0,
    replicas: Sequence[ReplicaLoad] = (),
    kinds: KindWork | None = None,
    completed_work: float | None = None,
) -> ArrivalsDecision:
    """This round's share for one route.

    `demand`: the route's requests per second; `slots`: the owned replicas' batch slots
    (fresh telemetry); `running`: their mean running / batch size; `fill`: their mean
    (running + waiting) / batch size; `completions`: what they completed per second over the
    last ``SAMPLE_WINDOW``; `service_time`: their mean seconds per request (first to last
    byte); `completed`: what they completed per second over a longer window, full or not, a
    lower bound of their capacity; `session_share`: the share of the requests started on the route's own replicas
    that had a session (``xdsserver.arrivals.ArrivalBook.session_shares``); `queued`: the
    requests waiting for a slot on the owned replicas; `objective`: the route's TTFT
    objective in seconds (``Overflow.ttft``), without which no queue is drained
    (``drain_rate``); `conversations`: ``Overflow.conversations``: with ``last`` the drain
    takes requests without a session only, never conversations (the share it adds stops at
    the share of the demand without one).

    In work (module docstring), when `kinds` (the route's responses by kind over the window)
    give a mean: `replicas`, each owned replica's batch, running share and the work it
    completed over the last ``SAMPLE_WINDOW``, for the capacity sample; `completed_work`:
    the work the owned replicas completed per second over the long window, its lower bound.
    The capacity is then carried in requests at the current mix, and the share of plain
    requests from the share of the work without a session."""
    before = previous or ArrivalsDecision()
    mix = kinds.mean() if kinds is not None else None
    replicas_full_since = {
        replica.key: min(before.replicas_full_since.get(replica.key, now), now)
        for replica in replicas
        if replica.running >= FULL
    }
    work_per_slot = before.work_per_slot
    # The engines' computed rates where the telemetry has them; else the responses' work.
    weight, sample = RATE_WEIGHT, rate_sample(replicas)
    if sample is None:
        untimed = [replica for replica in replicas if replica.rate is None]
        weight, sample = SAMPLE_WEIGHT, work_sample(untimed, replicas_full_since, now, service_time)
    if sample is not None:
        work_per_slot = round(
            sample if work_per_slot is None else (1 - weight) * work_per_slot + weight * sample,
            6,
        )
    # Capacity, from the completions of a full period when there is one.
    full = running is not None and running >= FULL
    full_since = (min(before.full_since, now)) if full else math.inf
    per_slot = before.per_slot
    if (
        full
        and now - full_since >= SAMPLE_WINDOW
        and completions is not None
        and completions > 0
        and slots > 0
    ):
        sample = completions / slots
        per_slot = (
            sample if per_slot is None else (1 - SAMPLE_WEIGHT) * per_slot + SAMPLE_WEIGHT * sample
        )
        per_slot = round(per_slot, 6)
    capacity: float | None
    lower: float | None
    if mix is not None and kinds is not None:
        # In work: the held work per slot at the current mix of kinds, else the prior.
        if work_per_slot is not None and slots > 0:
            capacity, measured = round(work_per_slot * slots / mix, 4), True
        else:
            capacity, measured = capacity_of(None, slots, service_time)
        lower = completed_work / mix if completed_work is not None else None
        # Every pool's responses show the kinds' work wherever they were served.
        share = kinds.plain_work_share()
        plain_share = round(share, 4) if share is not None else before.plain_share
    else:
        capacity, measured = capacity_of(per_slot, slots, service_time)
        lower = completed
        # What share of the demand has no session: learned while nothing overflows.
        plain_share = before.plain_share
        if before.paid == 0 and session_share is not None:
            plain_share = round(min(1.0, max(0.0, 1.0 - session_share)), 4)
    if capacity is not None and lower is not None and lower > capacity:
        # What they served is capacity they have, full or not: an estimate below it sends
        # more to paid than needed, and then the batches never fill to measure it.
        capacity = round(lower, 4)
    base = replace(
        before,
        demand=demand,
        capacity=capacity,
        measured=measured,
        per_slot=per_slot,
        full_since=full_since,
        work_per_slot=work_per_slot,
        replicas_full_since=replicas_full_since,
        work=round(mix, 2) if mix is not None else None,
        plain_share=plain_share,
        queued=queued,
        drain=0.0,
        fill=fill,
        recover_interval=recover_interval,
    )
    if not demand or capacity is None or fill is None:
        # No estimate (no arrivals reported, no capacity, or no fresh telemetry): nothing to
        # paid pools, as the fill loop without telemetry.
        why = (
            "no fresh telemetry"
            if fill is None
            else "no capacity estimate yet"
            if capacity is None
            else "no arrivals reported"
        )
        since = before.since if before.paid == 0 else now
        return replace(
            base, paid=0.0, since=since, target=0.0, why=why, high_since=math.inf, step_fill=None
        )
    # The trim, from the batch fill (as spill's).
    trim, trim_since = before.trim, before.trim_since
    queueing = fill > HIGH_FILL
    high_since = (min(before.high_since, now)) if queueing else math.inf
    if now - max(trim_since, before.since) >= DWELL:
        wanted = trim
        draining = before.step_fill is not None and fill < before.step_fill
        if queueing:
            lasting = before.paid > 0 or now - high_since >= LASTING
            if lasting and not draining:
                wanted = trim * max(MAX_CUT, TARGET_FILL / fill)
        elif fill < LOW_FILL and before.paid > 0:
            # Room with a share in force says the capacity reads low, but only when the
            # share is what the estimate asked for: room made by draining a queue or by a
            # share held above the estimate (hysteresis) is the share's own doing.
            if before.drain == 0 and before.paid <= before.target + DEADBAND:
                wanted = trim + STEP
        elif fill < LOW_FILL and trim < 1.0:
            wanted = min(1.0, trim + STEP)
        wanted = round(min(TRIM_RANGE[1], max(TRIM_RANGE[0], wanted)), 4)
        if wanted != trim:
            trim, trim_since = wanted, now
    keep = trim * LOAD * capacity / demand
    target = round(max(0.0, 1.0 - keep), 4)
    drain, allowed = drain_rate(queued, capacity, objective)
    if drain > 0:
        # The queue beyond the objective's goes to paid as well; with conversations last
        # only as far as the requests without a session reach.
        limit = (
            1.0
            if conversations == "with"
            else (PLAIN_PRIOR if plain_share is None else plain_share)
        )
        drained = round(max(0.0, 1.0 - keep + drain / demand), 4)
        drain_share = max(target, min(drained, limit)) - target
        drain = round(drain_share * demand, 4)
        target = round(target + drain_share, 4)
    paid, since, step_fill = before.paid, before.since, before.step_fill
    if trim_since == now:
        step_fill = fill
    rise = target >= paid + DEADBAND
    if recent is not None and recent > demand:
        # Falls wait for the recent rate too: in a rise the long window still holds the
        # lower rate of before, and a share given back then is a queue a second later.
        held = round(max(0.0, 1.0 - trim * LOAD * capacity / recent), 4)
        floor = max(target, min(held, paid))
    else:
        floor = target
    fall = (
        paid > 0 and now - since >= recover_interval and (floor <= paid - DEADBAND or floor == 0.0)
    )
    if rise:
        paid, since, step_fill = target, now, fill
    elif fall:
        paid, since, step_fill = floor, now, fill
    what = "measured full" if measured else "prior"
    if mix is not None:
        what += f"; in work, {mix:.0f} a request, {capacity * mix:.0f}/s"
    excess = round(target - drain / demand, 4) if drain > 0 else target
    if excess > 0:
        why = (
            f"demand {demand:.2f}/s above {trim * LOAD:.2f} x capacity {capacity:.2f}/s "
            f"({what}): {excess:.0%} to paid"
        )
    else:
        why = f"demand {demand:.2f}/s within {trim * LOAD:.2f} x capacity {capacity:.2f}/s ({what})"
    if drain > 0 and queued is not None:
        why += (
            f"; queue {queued:.0f} above the objective's {allowed:.1f}: {drain:.2f}/s more "
            f"to drain it, {target:.0%} to paid"
        )
    if paid != target:
        held_by = f", the last seconds' {recent:.2f}/s" if floor > target and recent else ""
        why += f"; holding {paid:.0%} (hysteresis{held_by})"
    return replace(
        base,
        drain=drain,
        paid=paid,
        since=since,
        trim=trim,
        trim_since=trim_since,
        high_since=high_since,
        step_fill=step_fill,
        target=target,
        why=why,
    )


__all__ = [
    "FULL",
    "MIN_WORK_REQUESTS",
    "OVERFLOW_PARTS",
    "PLAIN_PRIOR",
    "PREFILL_WEIGHT",
    "PRIOR_SHARE",
    "QUEUE_WAIT",
    "RATE_WEIGHT",
    "RECENT_WINDOW",
    "RISE_SIGMAS",
    "SAMPLE_WEIGHT",
    "SAMPLE_WINDOW",
    "ArrivalsDecision",
    "KindWork",
    "ReplicaLoad",
    "blend_demand",
    "capacity_of",
    "computed_rate",
    "decide_arrivals",
    "drain_rate",
    "kind_shares",
    "rate_sample",
    "route_demand",
    "route_of",
    "settled",
    "work_of",
    "work_sample",
]
