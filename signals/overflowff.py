"""Overflow from the route's arrival rate against its owned replicas' capacity (pure, no I/O).

Which routes use it
-------------------
Routes with ``overflow.signal: arrivals`` (``policies.models.Overflow``). The fill loop
(``signals.overflow``) sees a rise of demand only as requests already admitted fill the
batches, seconds late. Here the route's Envoys report each request's start
(``xdsserver.arrivals``), so the paid share follows the demand itself:

    keep = trim x load x capacity / demand        paid share = max(0, 1 - keep)

``demand`` is the route's requests per second, whichever pool took them (its own replicas,
its overflow aggregates, its paid pools: ``route_demand``, every kvpilot replica's through
``controlplane.arrivals``; each counted over the long window, or since the rate's last
change point, ``xdsserver.arrivals.change_point_rate``), or this replica's own rate over
the last few seconds when that is above it beyond noise (``blend_demand``): a rise counts
within seconds, a fall waits for the shared rate. ``load`` (``Overflow.utilization``, 0.9
when unset; spill's ``LOAD``, 0.97, for a caller that gives none) leaves room so a queue
that formed while the share was found drains; lower, it keeps the queue shorter at a peak
and pays for more requests.

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
Where the route's responses carry an OpenAI ``usage``, demand and capacity are counted in the
work the owned replicas compute rather than in requests (``signals.overflowwork``): a
capacity measured while the replicas serve conversations alone is then not read as fewer
requests of the mix than they can take. Without usage, the unit is requests, as above.

The trim, as spill's
--------------------
The batch fill ((running + waiting) / batch size) corrects the estimate rather than the
share (``signals.spill``'s constants): above ``HIGH_FILL`` while a paid share has been in
force for a ``DWELL`` (or a queue lasting ``LASTING`` seconds without one) and not draining,
``trim`` falls in proportion (``TARGET_FILL / fill``, at most to ``MAX_CUT`` of itself);
below ``LOW_FILL`` (times ``load`` over spill's ``LOAD`` when ``load`` is lower: the room a
lower load leaves is the setting's) with a paid share it rises by ``STEP``, but only while
that share is what the estimate asked for (room made by a drain or by a share held above the
estimate is the share's doing: in the cost benchmark it raised the trim from 0.97 to 1.46
over the peak and sent 3% to paid at 140% of capacity); bounded by ``TRIM_RANGE``, changed
at most once a ``DWELL``. Above 1 only while the capacity is the prior: a measured one is
what the engines computed at full batches, and a trim above 1 there undid the operator's
``load`` (0.8 read as 0.96 in the cost benchmark).

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

from signals.overflowshare import (
    PLAIN_PRIOR,
    PRIOR_SHARE,
    QUEUE_WAIT,
    capacity_of,
    drain_rate,
    kind_shares,
)
from signals.overflowwork import (
    FULL,
    RATE_WEIGHT,
    SAMPLE_WINDOW,
    KindWork,
    ReplicaLoad,
    Scrapes,
    full_scrapes,
    rate_sample,
    work_sample,
)
from signals.prefillfit import PrefillFit, Starts, fit_intervals, route_weight, weight_source
from signals.prefillrecord import FitScope
from signals.spill import (
    DEADBAND,
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

SAMPLE_WEIGHT = 0.5
"""Weight of a new capacity sample against the held one."""


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
    scrapes: Scrapes = field(default_factory=dict)
    """The owned replicas full at their last scrapes (``full_scrapes``; absent: not full)."""
    fit: PrefillFit = field(default_factory=PrefillFit)
    """What a prefilled token costs against an output token, learned from the owned
    engines' counters while busy (``signals.prefillfit``)."""
    fit_starts: Starts = field(default_factory=dict)
    """The owned replicas' open intervals of that fit (``fit_intervals``)."""
    scope: FitScope | None = field(default=None, compare=False)
    """The owned pools and batch size the fit is learned on (stored with it)."""
    fixed_weight: float | None = field(default=None, compare=False)
    """The route's ``overflow.prefillWeight`` when set: the weight used instead of the fit's
    (which still learns, for status)."""
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
    def prefill_weight(self) -> float:
        """The weight a prefilled token counts at in this route's work: the route's own
        (``fixed_weight``), else the learned one, or ``PREFILL_WEIGHT`` until the fit can
        say (``signals.prefillfit.route_weight``)."""
        return route_weight(self.fit, self.fixed_weight)

    @property
    def weight_source(self) -> str:
        """Where ``prefill_weight`` comes from (``signals.prefillfit.weight_source``)."""
        return weight_source(self.fit, self.fixed_weight)

    @property
    def next_at(self) -> float:
        """When a step back is due although nothing else triggers a rebuild."""
        if self.paid > 0 and self.target < self.paid:
            return self.since + self.recover_interval
        return math.inf


def prefill_weight(decision: ArrivalsDecision | None, fixed: float | None = None) -> float:
    """The weight a route's work counts a prefilled token at this round: `fixed` (the
    route's ``overflow.prefillWeight``) when set, else what its last decision's fit learned,
    ``PREFILL_WEIGHT`` before it can say."""
    return route_weight(decision.fit if decision is not None else None, fixed)


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
    load: float = LOAD,
    fixed_weight: float | None = None,
    fit: PrefillFit | None = None,
    scope: FitScope | None = None,
) -> ArrivalsDecision:
    """This round's share for one route.

    `demand`: the route's requests per second; `slots`: the owned replicas' batch slots
    (fresh telemetry); `running`: their mean running / batch size; `fill`: their mean
    (running + waiting) / batch size; `completions`: what they completed per second over the
    last ``SAMPLE_WINDOW``; `service_time`: their mean seconds per request (first to last
    byte); `completed`: what they completed per second over a longer window, full or not, a
    lower bound of their capacity; `session_share`: the share of the requests started on the
    route's own replicas that had a session
    (``xdsserver.arrivals.ArrivalBook.session_shares``); `queued`: the requests waiting for
    a slot on the owned replicas; `objective`: the route's TTFT objective in seconds
    (``Overflow.ttft``), without which no queue is drained
    (``drain_rate``); `conversations`: ``Overflow.conversations``: with ``last`` the drain
    takes requests without a session only, never conversations (the share it adds stops at
    the share of the demand without one); `load`: the share of the capacity the owned
    replicas carry (``Overflow.utilization``).

    In work (module docstring), when `kinds` (the route's responses by kind over the window)
    give a mean: `replicas`, each owned replica's batch, running share and the work it
    completed over the last ``SAMPLE_WINDOW``, for the capacity sample; `completed_work`:
    the work the owned replicas completed per second over the long window, its lower bound.
    The capacity is then carried in requests at the current mix, and the share of plain
    requests from the share of the work without a session. A prefilled token counts at
    `fixed_weight` (``Overflow.prefillWeight``) when set, else at what the fit carried in
    `previous` learned (``prefill_weight``); the replicas' busy stretches this round go
    into the fit (``signals.prefillfit.fit_intervals``), `fit` when given (a stored one,
    ``signals.prefillrecord.seeded``) instead of `previous`'s, learned on `scope`."""
    before = previous or ArrivalsDecision()
    if fit is not None:
        before = replace(before, fit=fit)
    # Work weighs a prefilled token as set, or as the fit had it before this round: the
    # callers (signals.live) weighed the replicas' work with the same (prefill_weight).
    prefill = prefill_weight(before, fixed_weight)
    mix = kinds.mean(prefill) if kinds is not None else None
    replicas_full_since = {
        replica.key: min(before.replicas_full_since.get(replica.key, now), now)
        for replica in replicas
        if replica.running >= FULL
    }
    work_per_slot = before.work_per_slot
    # The engines' computed rates where the telemetry has them, each scrape once and only
    # after a few full ones; else the responses' work.
    scrapes, counted = full_scrapes(replicas, before.scrapes, now, prefill)
    fit_starts, fit = fit_intervals(replicas, before.fit_starts, before.fit)
    weight, sample = RATE_WEIGHT, rate_sample(counted)
    start = work_per_slot
    if sample is not None and start is None and mix is not None and service_time:
        # The first rate is averaged in from the prior in work, not taken outright.
        start = PRIOR_SHARE / service_time * mix
    if sample is None:
        untimed = [replica for replica in replicas if replica.rate is None]
        weight, sample = SAMPLE_WEIGHT, work_sample(untimed, replicas_full_since, now, service_time)
    if sample is not None:
        work_per_slot = round(
            sample if start is None else (1 - weight) * start + weight * sample,
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
        share = kinds.plain_work_share(prefill)
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
    learned = route_weight(fit, fixed_weight)
    if learned != prefill and work_per_slot is not None and kinds is not None:
        # The unit changes from next round: the held capacity is carried over at the same
        # requests a second at this mix, so the share does not jump with the unit; the
        # engines' next full scrapes then measure it in the new one.
        old, new = kinds.mean(prefill), kinds.mean(learned)
        if old and new:
            work_per_slot = round(work_per_slot * new / old, 6)
    base = replace(
        before,
        demand=demand,
        capacity=capacity,
        measured=measured,
        per_slot=per_slot,
        full_since=full_since,
        work_per_slot=work_per_slot,
        replicas_full_since=replicas_full_since,
        scrapes=scrapes,
        fit=fit,
        fit_starts=fit_starts,
        scope=scope if scope is not None else before.scope,
        fixed_weight=fixed_weight,
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
    # Room is judged against the load asked for: a replica kept at a lower share of its
    # capacity shows a lower fill, which is the setting's doing, not a capacity read low.
    room = fill < LOW_FILL * min(1.0, load / LOAD)
    high_since = (min(before.high_since, now)) if queueing else math.inf
    # A measured capacity is not raised by the fill: what the engines computed at full
    # batches is what they can, and room below it is the load asked for (``load``).
    ceiling = 1.0 if measured else TRIM_RANGE[1]
    if trim > ceiling:
        trim, trim_since = ceiling, now
    if now - max(trim_since, before.since) >= DWELL:
        wanted = trim
        draining = before.step_fill is not None and fill < before.step_fill
        if queueing:
            lasting = before.paid > 0 or now - high_since >= LASTING
            if lasting and not draining:
                wanted = trim * max(MAX_CUT, TARGET_FILL / fill)
        elif room and before.paid > 0:
            # Room with a share in force says the capacity reads low, but only when the
            # share is what the estimate asked for: room made by draining a queue or by a
            # share held above the estimate (hysteresis) is the share's own doing.
            if before.drain == 0 and before.paid <= before.target + DEADBAND:
                wanted = trim + STEP
        elif room and trim < 1.0:
            wanted = min(1.0, trim + STEP)
        wanted = round(min(ceiling, max(TRIM_RANGE[0], wanted)), 4)
        if wanted != trim:
            trim, trim_since = wanted, now
    keep = trim * load * capacity / demand
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
        held = round(max(0.0, 1.0 - trim * load * capacity / recent), 4)
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
        known = weight_source(before.fit, fixed_weight)
        what += (
            f"; in work, {mix:.0f} a request, {capacity * mix:.0f}/s, a prefilled token at "
            f"{prefill:.3f} ({known}, {fit.intervals} intervals)"
        )
    excess = round(target - drain / demand, 4) if drain > 0 else target
    if excess > 0:
        why = (
            f"demand {demand:.2f}/s above {trim * load:.2f} x capacity {capacity:.2f}/s "
            f"({what}): {excess:.0%} to paid"
        )
    else:
        why = f"demand {demand:.2f}/s within {trim * load:.2f} x capacity {capacity:.2f}/s ({what})"
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
    "PLAIN_PRIOR",
    "PRIOR_SHARE",
    "QUEUE_WAIT",
    "SAMPLE_WEIGHT",
    "ArrivalsDecision",
    "capacity_of",
    "decide_arrivals",
    "drain_rate",
    "kind_shares",
    "prefill_weight",
]
