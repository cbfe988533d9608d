"""When a route's replicas are saturated, for bounded load that tightens then (pure, no I/O).

Which routes use it
-------------------
Routes with ``balancing: telemetry`` and session affinity whose
``sessionAffinity.saturatedHashBalanceFactor`` is set (100 by default on such routes). Their
affinity cluster has a second consistent-hash twin: the same endpoints, the same EDS
resource and so the same ring, bounded at that tighter factor. The route's session entries
point at one twin or the other; this module decides which, from the same telemetry records
the weights read, and the choice travels in the route configuration (RDS): no cluster
changes, so Envoy keeps both twins' in-flight counts and connections.

Why two bounds
--------------
Bounded load caps a host at a factor of the mean requests in flight. In the scenario
benchmark, with room in the pool, 125% was best: a turn spills only from a replica that is
clearly busier than the rest, and a spilled turn pays its whole history's prefill
elsewhere. Once the replicas' batches are full, what costs is a queue at one replica while
another has a free slot, and there 100% (no host above the mean, rounded up) cut TTFT p99
in overload to under half of 125%'s, for a few points of hit rate. One factor cannot be
both; Envoy counts requests per cluster, and changing a cluster's factor (CDS) gives Envoy
a new cluster whose hosts start with nothing counted, so the factor is not changed in place.

The signal
----------
Batch fill: for each fresh record (younger than the pool's ``maxAge``) of the route's
first tier that knows its batch size, ``(running + waiting) / max_running``; the pool's fill
is their mean. Saturated from the fill at which the usual bound lets a replica's batch
overflow: ``100 / hashBalanceFactor`` (0.8 at 125%; a replica may carry 1.25 times the mean,
so at a mean fill of 0.8 the busiest one queues while others have room). Calm again at
``CALM_SHARE`` of that or below (0.6 at 125%), and not before ``MIN_DWELL`` seconds in the
saturated state: the band and the dwell keep a pool near the bound from switching twins
every round. In the scenario benchmark chat at 75% of capacity peaked at a fill of 0.70 and
the 110% overload held 0.75 to 1.1. Without a record that knows its batch size
(``kvpilot agent --max-running``) there is no fill, and the route stays calm.

The bound that follows capacity
-------------------------------
Two fixed bounds are a multiple of the mean, and the mean is the wrong unit: what matters is
whether a replica can take a request into its batch soon. Envoy lets a host carry
``factor / 100`` times the mean requests in flight, so with batch size ``B`` and mean ``m``
the factor ``100 * B / m`` would let the busiest replica fill its batch. Two things make
that too loose on small batches, both seen in the scenario benchmark at batch size 8, where
the slowest first tokens came from a replica holding 9 to 12 requests (past its 8 slots)
right after a burst, waiting a second or more for a slot:

- Envoy applies the factor to the live mean, the control plane chose it from the mean of
  the last scrape; between the two, the busiest replica's count moves by about its square
  root (arrivals are close to Poisson). So the factor is sized for the *usable* batch,
  ``B - sqrt(B)`` (``usable_batch``: 5.2 of 8, 26.3 of 32, 116.7 of 128): the square-root
  headroom of a queue with ``B`` servers. A slot waited for costs about a request's lifetime
  over ``B``: seconds at 8, little at 128, where the headroom is a tenth of the batch.
- A lull (fewer requests for a few seconds) made the factor jump to the top rung, and the
  burst that ended it found a bound sized for an idle pool. So the mean the factor is
  computed from is its held peak (``held_peak``): this round's mean, or the last peak
  decayed by ``e`` every ``PEAK_HOLD`` seconds, whichever is larger.

At batches of 8 half full that is 129 (the fixed bounds' 125); at batches of 32 or 128,
where the calm mean is a smaller share of the batch, 200 or more, where 125 spilled turns
that would have been served at once (each paying its history's prefill elsewhere). A
``capacityBound`` route (``decide_bound``) takes the largest rung of its ladder
(``SessionAffinity.ladder``) at or below that factor: every rung is a twin of the same ring,
so a change of rung is a route update (RDS) and never a cluster update (CDS). Its top rung
is no bound at all (``UNBOUNDED_RUNG``, the plain consistent hash of the same ring), taken
from a factor of 100 x the replicas reporting (``unbounded_at``): there the whole pool's
requests in flight fit the busiest replica's usable batch, and any bound would only spill
a popular document or session off the replica that holds its prefix, which its batch would
have taken at once. It tightens as
soon as the factor falls below its rung by ``TIGHTEN_MARGIN`` (a queue is building) and
loosens only when the
factor clears the next rung by ``LOOSEN_MARGIN`` and ``LOOSEN_DWELL`` seconds after its last
change (or after the first record that knew the batch size: the first record takes the
loosest bound that fits, never no bound, so a pool that starts idle waits for the dwell
before it takes no bound and tightens from a bound as its load ramps up), so a pool near a
rung does not switch every round. Fewer switches matter beyond the
route updates: Envoy counts requests in flight per cluster, so right after a switch the new
twin does not see the requests the old one sent, and its bound holds only as those finish.

Small batches: the fixed bounds instead of the ladder
-----------------------------------------------------
The ladder pays only where one scrape's noise is small against the batch (``ladder_pays``:
batches above 16). At smaller batches a ``capacityBound`` route takes the two fixed bounds'
decisions (``decide_saturation``) and compiles to their twins alone
(``decide_capacity_route``); the batch size it was decided from is kept, so a route whose
telemetry goes stale keeps its path. Before any record knew its batch size the route keeps
the ladder it asked for (its session requests take ``hashBalanceFactor`` either way).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from policies.models import UNBOUNDED_RUNG, Endpoint
from signals.telemetry import TelemetryRecord

CALM_SHARE = 0.75
"""A saturated pool is calm again at this share of the fill that saturates it ..."""
MIN_DWELL = 5.0
"""... once it has been saturated for at least this many seconds."""


def saturated_fill(hash_balance_factor: int) -> float:
    """The mean batch fill at which a route bounded at `hash_balance_factor` percent counts
    as saturated: where its busiest replica may reach a full batch (1.0 without a bound)."""
    return min(1.0, 100 / hash_balance_factor) if hash_balance_factor else 1.0


@dataclass(frozen=True, slots=True)
class SaturationDecision:
    """Whether one route's replicas are saturated; kept between rounds for hysteresis."""

    saturated: bool = False
    """Session requests go to the tighter twin."""
    since: float = -math.inf
    """Wall-clock time of the last change."""
    # For operators; they change nothing Envoy is sent, so they are left out of equality.
    fill: float | None = field(default=None, compare=False)
    """Mean batch fill this round; ``None`` without a fresh record that knows its batch."""
    bound: float = field(default=1.0, compare=False)
    """The fill at which the route counts as saturated (``saturated_fill``)."""
    factor: int = 0
    """``capacityBound`` routes: the bounded load session requests take (a rung of the
    route's ladder); 0 on other routes (``saturated`` says which of two bounds)."""
    wanted: float | None = field(default=None, compare=False)
    """``capacityBound`` routes: the factor at which the busiest replica fills the usable part
    of its batch this round, at the held peak of the mean in flight (``capacity_factor``)."""
    peak: float | None = field(default=None, compare=False)
    """``capacityBound`` routes: the mean requests in flight the rung is sized for: this
    round's mean, or the last peak decayed by ``PEAK_HOLD``, whichever is larger."""
    peak_at: float = field(default=-math.inf, compare=False)
    """When ``peak`` was computed."""
    loosen_at: float = field(default=math.inf, compare=False)
    """``capacityBound`` routes: when the next looser rung is due if nothing changes (its dwell
    ends and the held peak has faded enough); infinite when none can be."""
    ladder: bool | None = None
    """``capacityBound`` routes: whether they take the ladder (``decide_bound``, one twin per
    rung) or, at batches too small for it (``ladder_pays``), the two fixed bounds
    (``decide_saturation`` and their two twins); ``None`` on other routes. It changes the
    route's clusters, so it counts in equality."""
    batch: float | None = field(default=None, compare=False)
    """``capacityBound`` routes: the mean batch size the path was chosen from (the last one
    known, kept while telemetry is stale)."""
    path: str | None = field(default=None, compare=False)
    """``capacityBound`` routes: which path and why, for operators (``path_reason``)."""

    @property
    def calm_at(self) -> float:
        """When a saturated route whose fill is already down to the calm bound turns calm if
        nothing changes (its dwell ends): the control plane rebuilds then even if no telemetry
        arrives. Infinite otherwise."""
        if self.factor:
            return self.loosen_at
        if self.saturated and self.fill is not None and self.fill <= self.bound * CALM_SHARE:
            return self.since + MIN_DWELL
        return math.inf


def batch_fill(
    endpoints: Sequence[Endpoint],
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float,
    max_age: float,
) -> float | None:
    """The mean batch fill of the replicas ``endpoints`` (see the module notes);
    ``telemetry`` is keyed by ``Endpoint.key``."""
    return mean_fill(sized_records(endpoints, telemetry, now=now, max_age=max_age))


def mean_fill(records: Sequence[tuple[TelemetryRecord, float]]) -> float | None:
    """The mean batch fill, (running + waiting) / batch size, of `records` (``sized_records``);
    None without one."""
    fills = [
        ((record.running or 0.0) + (record.waiting or 0.0)) / batch for record, batch in records
    ]
    return round(statistics.fmean(fills), 6) if fills else None


def sized_records(
    endpoints: Sequence[Endpoint],
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float,
    max_age: float,
) -> list[tuple[TelemetryRecord, float]]:
    """The fresh records (no older than `max_age`) of ``endpoints`` that know their batch
    size, each with that size (``max_running``); ``telemetry`` is keyed by
    ``Endpoint.key``."""
    return [
        (record, record.max_running)
        for endpoint in endpoints
        if (record := telemetry.get(endpoint.key)) is not None
        and record.max_running
        and now - record.at <= max_age
    ]


def decide_saturation(
    previous: SaturationDecision | None, fill: float | None, *, now: float, bound: float
) -> SaturationDecision:
    """This round's decision from the last one and the pool's batch fill; `bound` is the
    fill that saturates the route (``saturated_fill``)."""
    before = previous or SaturationDecision()
    saturated = before.saturated
    if fill is None:
        # No evidence: fail calm, as stale weights go neutral.
        saturated = False
    elif not saturated and fill >= bound:
        saturated = True
    elif saturated and fill <= bound * CALM_SHARE and now - before.since >= MIN_DWELL:
        saturated = False
    since = before.since if saturated == before.saturated else now
    return SaturationDecision(saturated=saturated, since=since, fill=fill, bound=bound)


LOOSEN_MARGIN = 1.1
"""A capacity-bound route moves to a looser rung only when the factor its replicas allow
clears that rung by this much: the rung's headroom against the noise of one scrape."""
TIGHTEN_MARGIN = 1.1
"""... and keeps its rung while the factor stays within this much below it: the busiest
replica may go past its usable batch by a tenth at most, still within the batch (29 of 32),
and a burst a few percent above what fits does not take a rung a third to half tighter."""
LOOSEN_DWELL = 15.0
"""... and no sooner than this many seconds after its last change of rung. Each change sends
session requests to a twin whose in-flight counts hold only its own requests, so for a while
its bound spills hot sessions and documents it should keep (or keeps what it should spill):
at batch size 8 a 5 s dwell changed the rung 7 to 9 times per 40 s run and cost the
documents mix hit rate."""
PEAK_HOLD = 30.0
"""Seconds over which the peak of a pool's mean in flight decays (by a factor of e): a lull
loosens the rung only as the peak it follows fades, so the burst that ends the lull does not
find a bound sized for an idle pool (about the lifetime of a few requests)."""


def held_peak(previous: SaturationDecision | None, mean: float, *, now: float) -> float:
    """The mean in flight a capacity-bound route sizes its rung for: `mean`, or the previous
    round's peak decayed over ``PEAK_HOLD`` seconds, whichever is larger."""
    if previous is None or previous.peak is None:
        return mean
    decayed = previous.peak * math.exp(-max(0.0, now - previous.peak_at) / PEAK_HOLD)
    return max(mean, decayed)


def in_flight(
    endpoints: Sequence[Endpoint],
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float,
    max_age: float,
) -> tuple[float, float] | None:
    """(mean requests in flight, mean batch size) over the fresh records of ``endpoints``
    that know their batch size; ``None`` without one."""
    return mean_in_flight(sized_records(endpoints, telemetry, now=now, max_age=max_age))


def mean_in_flight(records: Sequence[tuple[TelemetryRecord, float]]) -> tuple[float, float] | None:
    """(mean requests in flight, mean batch size) of `records` (``sized_records``); ``None``
    without one."""
    if not records:
        return None
    return (
        round(statistics.fmean((r.running or 0.0) + (r.waiting or 0.0) for r, _ in records), 6),
        round(statistics.fmean(batch for _, batch in records), 6),
    )


def usable_batch(batch: float) -> float:
    """The share of a batch of `batch` sequences the busiest replica may fill and still take
    the next request soon: ``batch - sqrt(batch)``, at least 1 (5.2 of 8, 26.3 of 32, 116.7 of
    128; see the module notes)."""
    return max(1.0, batch - math.sqrt(batch))


def capacity_factor(batch: float, mean: float) -> float:
    """The bounded load (percent of the mean) at which the busiest replica just fills the
    usable part of its batch: ``100 * usable_batch(batch) / mean``; infinite while nothing is
    in flight."""
    return math.inf if mean <= 0 else 100.0 * usable_batch(batch) / mean


def unbounded_at(replicas: int, ladder: Sequence[int]) -> float:
    """The factor from which a ``capacityBound`` route takes its ladder's ``UNBOUNDED_RUNG``
    (no bound): 100 x `replicas` (those with fresh records that know their batch), where the
    busiest replica's usable batch holds all the pool's requests in flight, so a bound could
    spill only what a batch would have taken at once (and a factor that high never binds in
    Envoy anyway: it lets one host carry them all). Never below the ladder's last bound, so
    the rungs stay in order on pools of three replicas or fewer; infinite without a replica."""
    if replicas <= 0:
        return math.inf
    top = max((r for r in ladder if r != UNBOUNDED_RUNG), default=0)
    return float(max(100 * replicas, top))


def exported_bound(factor: int) -> int:
    """A rung as operators see it (``kvpilot_route_bounded_load``, the status's
    ``boundedLoad``): its percent, or 0 for ``UNBOUNDED_RUNG`` (no bound, as
    ``hashBalanceFactor: 0``)."""
    return 0 if factor == UNBOUNDED_RUNG else factor


def bound_text(factor: int) -> str:
    """A rung in a log line: ``the 300% bound``, or ``no bound``."""
    return "no bound" if factor == UNBOUNDED_RUNG else f"the {factor}% bound"


def decide_bound(
    previous: SaturationDecision | None,
    load: tuple[float, float] | None,
    *,
    now: float,
    ladder: Sequence[int],
    usual: int,
    replicas: int = 0,
) -> SaturationDecision:
    """This round's rung for a ``capacityBound`` route from the last one and `load` (mean in
    flight, batch size; ``in_flight``); `ladder` ascending (``SessionAffinity.ladder``),
    `usual` the rung without evidence, `replicas` how many fresh records `load` is the mean
    of (the ladder's ``UNBOUNDED_RUNG`` is taken at ``unbounded_at`` of them; never with 0)."""
    before = previous if previous is not None and previous.factor else None
    current = before.factor if before is not None else usual
    since = before.since if before is not None else -math.inf
    peak: float | None = None
    top = unbounded_at(replicas, ladder)

    def fits_at(rung: int) -> float:
        """The factor from which `rung` fits (its bound, or ``unbounded_at`` for no bound)."""
        return top if rung == UNBOUNDED_RUNG else float(rung)

    if load is None:
        # No evidence: the usual bound, as stale weights go neutral.
        factor, wanted, fill = usual, None, None
    else:
        mean, batch = load
        first = before is None or before.peak is None
        if first:
            # The first evidence (a new route, or telemetry back): the dwell starts now, so
            # a pool that starts idle does not take no bound and then tighten a rung at a
            # time as its load ramps up, each change a twin that has counted nothing yet.
            since = now
        peak = held_peak(before, mean, now=now)
        wanted = capacity_factor(batch, peak)
        fill = round(mean / batch, 6) if batch else None
        fits = [r for r in ladder if fits_at(r) <= wanted] or [ladder[0]]
        factor = current
        if wanted * TIGHTEN_MARGIN < fits_at(current):
            # Tighten at once, also from no bound when the pool fills (or loses replicas).
            factor = fits[-1]
        else:
            looser = [
                r
                for r in ladder
                if fits_at(r) > fits_at(current) and fits_at(r) * LOOSEN_MARGIN <= wanted
            ]
            if looser and now - since >= LOOSEN_DWELL:
                factor = looser[-1]
            elif first and (bounded := [r for r in looser if r != UNBOUNDED_RUNG]):
                # Through the first dwell, the loosest bound that fits: at 125% a ramp spills
                # a document's first requests off its replica, which later meets it cold.
                factor = bounded[-1]
    if factor != current:
        since = now
    loosen_at = math.inf
    looser = [r for r in ladder if fits_at(r) > fits_at(factor)]
    if load is not None and peak is not None and looser and math.isfinite(fits_at(looser[0])):
        # The next looser rung is due once its dwell is over and the held peak has faded to
        # where the factor clears that rung by the margin; never while this round's mean
        # itself is above that.
        target = 100.0 * usable_batch(load[1]) / (fits_at(looser[0]) * LOOSEN_MARGIN)
        if load[0] <= target:
            fade = PEAK_HOLD * math.log(peak / target) if peak > target else 0.0
            loosen_at = max(since + LOOSEN_DWELL, now + fade)
    return SaturationDecision(
        saturated=factor == ladder[0],
        since=since,
        fill=fill,
        bound=1.0,
        factor=factor,
        wanted=None if wanted is None else round(min(wanted, 1e6), 3),
        loosen_at=loosen_at,
        peak=None if peak is None else round(peak, 6),
        peak_at=now,
    )


def ladder_pays(batch: float) -> bool:
    """Whether a ``capacityBound`` route over replicas that batch `batch` sequences takes the
    ladder of bounds rather than the two fixed bounds: when the usable batch is more than
    ``CALM_SHARE`` of the batch, ``batch - sqrt(batch) > CALM_SHARE * batch``, that is
    ``sqrt(batch) < (1 - CALM_SHARE) * batch``, or ``batch > 1 / (1 - CALM_SHARE) ** 2``:
    batches above 16 (``LADDER_MIN_BATCH``). False at 8 and 16, true at 17 and above (32, 128).

    Why: the square-root headroom (``usable_batch``) is the noise of one scrape in the
    busiest replica's count. The fixed bounds' hysteresis band, between the fill that
    saturates a route and ``CALM_SHARE`` of it, is a quarter of what it separates; a decision
    that moves with less than the noise is no decision. At batches of 16 or less the noise
    is that quarter of the batch or more, and the square root eats the batch: at 8 the
    usable batch is 5.2 (65%), and one request more or less in a mean of 1 to 4 in flight
    moves the factor ``100 * 5.2 / mean`` across a whole rung (517, 259, 172, 129), so the
    ladder's rungs are not apart enough to be worth the switches: every switch sends session
    requests to a twin that has not counted the requests in flight through the others. In
    the routing benchmark at batch size 8 the rung changed 4 to 6 times per 40 s run and its
    TTFT p99 was level with the fixed bounds' (1.01-1.18x), not better. At 32 the usable
    batch is 26.3 (82%); a request more in a mean of 8 to 16 moves the factor by a tenth,
    less than the rungs' spacing, and the ladder won (0.5-0.8x the fixed bounds' TTFT p99
    at 32 and 128). Without the floor of one sequence, so a batch of
    one or two is small too."""
    return math.sqrt(batch) < (1.0 - CALM_SHARE) * batch


LADDER_MIN_BATCH = 1.0 / (1.0 - CALM_SHARE) ** 2
"""The ladder needs batches above this (16): ``ladder_pays``."""


def path_reason(ladder: bool, batch: float | None, *, known: bool = True) -> str:
    """What a ``capacityBound`` route's status says about its path: ``batch 8: ladder needs >
    16; fixed bounds``, ``batch 32: ladder``, ``batch unknown: ladder`` (before any record
    knew it), ``batch 8 (last known): ...`` while telemetry is stale."""
    if batch is None:
        size = "batch unknown"
    else:
        size = f"batch {batch:g}" + ("" if known else " (last known)")
    if ladder:
        return f"{size}: ladder"
    return f"{size}: ladder needs > {LADDER_MIN_BATCH:g}; fixed bounds"


def decide_capacity_route(
    previous: SaturationDecision | None,
    load: tuple[float, float] | None,
    fill: float | None,
    *,
    now: float,
    ladder: Sequence[int],
    usual: int,
    saturated_at: float | None,
    replicas: int = 0,
) -> SaturationDecision:
    """This round's decision for a ``capacityBound`` route: its ladder (``decide_bound``) at
    batches where it pays (``ladder_pays``), else the fixed bounds' decision
    (``decide_saturation`` from the batch `fill`, at `saturated_at`, ``saturated_fill`` of
    ``hashBalanceFactor``; ``None`` when the route has no saturated bound: always calm).
    `load` is (mean in flight, mean batch size) (``in_flight``) over `replicas` fresh
    records. Without a known batch size the route keeps the path it took last (the ladder at
    first)."""
    known = load is not None
    if load is not None:
        batch: float | None = load[1]
        takes_ladder = ladder_pays(load[1])
    else:
        batch = previous.batch if previous is not None else None
        takes_ladder = previous is None or previous.ladder is not False
    # A change of path starts the other path's hysteresis afresh.
    before = previous if previous is not None and previous.ladder is takes_ladder else None
    if takes_ladder:
        decision = decide_bound(
            before, load, now=now, ladder=ladder, usual=usual, replicas=replicas
        )
    elif saturated_at is None:
        decision = SaturationDecision(fill=fill)
    else:
        decision = decide_saturation(before, fill, now=now, bound=saturated_at)
    return replace(
        decision,
        ladder=takes_ladder,
        batch=batch,
        path=path_reason(takes_ladder, batch, known=known),
    )


__all__ = [
    "CALM_SHARE",
    "LADDER_MIN_BATCH",
    "LOOSEN_DWELL",
    "LOOSEN_MARGIN",
    "MIN_DWELL",
    "PEAK_HOLD",
    "TIGHTEN_MARGIN",
    "SaturationDecision",
    "batch_fill",
    "bound_text",
    "capacity_factor",
    "decide_bound",
    "decide_capacity_route",
    "decide_saturation",
    "exported_bound",
    "held_peak",
    "in_flight",
    "ladder_pays",
    "mean_fill",
    "mean_in_flight",
    "path_reason",
    "saturated_fill",
    "sized_records",
    "unbounded_at",
    "usable_batch",
]
