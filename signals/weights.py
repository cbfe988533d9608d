"""From live telemetry to endpoint weights and health (pure, no I/O).

Which routes use it
-------------------
Only routes with ``balancing: telemetry``. Every other mode keeps the static weights of the
pool (round robin, least request and random have their own notion of balance, and ``orca``
lets Envoy weigh hosts itself from per-response load reports). Pools behind session affinity
get capacity weights (below); the others get load weights (the formula).

Pools behind session affinity: capacity, not load
-------------------------------------------------
On a consistent-hash cluster an endpoint's weight is its share of the ring, and every weight
change moves sessions to replicas that do not hold their KV cache. Load weights there pay with
cache locality for noise: a replica busy for a second loses sessions, which prefill from
scratch elsewhere and make that replica busy in turn. So load, the fast signal, is left to
Envoy's bounded load (per request, in every Envoy, with no control-plane delay), and telemetry
sets only what changes slowly: how fast each replica is.

- Speed: each record's mean time per output token (TPOT) against the pool's median TPOT;
  ``speed_e = median_j tpot_j / tpot_e``. A replica at half speed, or slowed by a noisy
  neighbour, takes longer per token whatever its load; a busy replica only a little longer.
  The median is the pool's only when more than half of its fresh endpoints gave a TPOT: as
  a pool drains, the slowest replicas are the last still decoding, and the median of those
  alone would read them at full speed. Without one, a record is no evidence either way.
- Slow, not busy: a step that prefills a long prompt stalls every sequence of the batch, so
  a replica busy with long prompts has a higher mean TPOT at full speed. Where the model
  server exports the TPOT histogram, its median between scrapes (a few long steps do not
  move it) must agree: the replica counts as slower only when its median TPOT too is
  beyond ``capacity_band`` of the median of the pool's medians (the buckets are coarse,
  about 2x apart, so the median says whether, the mean says how much). A record with too
  few tokens for a median (a slowed replica decoding one sequence) is no evidence either
  way: it neither counts towards a fall nor breaks a run of slow records.
- Busy with prompts the pool does not have: a burst of new documents on one replica puts a
  prefill chunk into most of its steps, and then its median TPOT reads it at a third of
  its speed too. The record's prompt tokens prefilled per output token (the prefix cache's
  queries less its hits) say so: above ``prefill_busy`` (2) times the pool's median (at
  least ``prefill_floor``), the record is no evidence either way, as above. In the
  scenario benchmark's documents mix such bursts cut a replica of a fleet of equal
  replicas to 50 and back, 2 to 6 ring changes a run that moved sessions off their
  caches; a slow replica prefills what the others do and still falls.
- Busy with more than its share of the sequences: a decode step takes longer the more
  sequences it holds (vLLM's, like the simulated replica's, grows by a fixed time per
  sequence on top of a fixed base), so a replica holding the popular prefixes decodes three
  times the pool's sequences at a TPOT well above the pool's, while it produces more tokens
  a second than any other. Its tokens a second (running sequences over TPOT, by Little's law)
  say so: at ``busy_throughput`` (1.5) times the pool's median or more, a slower record is no
  evidence of a fall (it neither counts towards one nor breaks a run). A slow replica given
  the pool's share of the work produces the pool's tokens a second (it only holds them
  longer), and one with fewer slots produces fewer: both fall as before. In the scenario
  benchmark's documents mix at batches of 128, the replica holding the popular documents
  carried 3x the pool's mean in flight and was cut to 70 for 12 to 19 s, and its documents'
  sessions moved off their caches.
- Capacity factor, on a ladder of levels (``capacity_levels``: 1, 0.7, 0.5, 0.35, 0.25). It
  falls only after ``capacity_confirm`` consecutive records put the replica below
  ``capacity_band`` times its level, straight to the level nearest the last one's speed
  (the first of them may still hold time from before a slowdown); it rises
  one level at a time after as many records at ``capacity_rise`` times the next level or
  faster, so sessions come back to a recovered replica gradually instead of in one spike.
  A rise too needs the median's word where the pool has medians: the others' long prefill
  steps inflate their mean TPOT, and the pool's reference with it, so a half-speed replica
  can read 0.75 on the mean while its median stays one bucket up (about half).
  The fall band is wide (0.65): a replica that only looks slower because it is busier
  (its steps carry more prefill) stays put, a half-speed or 3x-slowed one does not. The
  agents write a record that moved the speed and the two after it (``signals.writeband.WriteBand.speed``),
  so two slow records in a row arrive within three scrape intervals.
- ``weight_e = static_weight_e * factor_e``. Bounded load takes the weight into account too
  (a host's share of in-flight requests is capped in proportion to its weight), so a slow
  replica gets both fewer sessions and a smaller share of the spill.
- Never DEGRADED for load: degrading a ring-hash host moves all its sessions at once (evict);
  bounded load instead spills only the requests the host cannot take (spill).

Telemetry without a TPOT (an idle replica, a server that does not export it) is no evidence:
the factor stays where it is. Stale telemetry gives the static weight, as below.

The formula
-----------
For each endpoint ``e`` of a pool with fresh telemetry (younger than ``max_age``), with
``c_e`` its capacity (static weight divided by the pool's mean static weight):

1. Signals, each in [0, 1], normalized per pool::

       queue_e   = (waiting_e / c_e)        / max(queue_ref,  max_j waiting_j / c_j)
       running_e = running_e / max_running_e                  (when the batch size is known)
                 = (running_e / c_e)        / max(running_ref, max_j running_j / c_j)
       kv_e      = kv_cache_e
       tokens_e  = (pending_tokens_e / c_e) / max(tokens_ref, max_j pending_tokens_j / c_j)

   Dividing by the pool's busiest replica makes the inputs comparable across model servers
   and hardware; the ``*_ref`` floors keep small absolute differences (1 request queued
   against 0) from looking like large relative ones. A missing signal counts as 0.

2. Load, in [0, 1]: ``load_e = min(1, 1.0*queue_e + 0.5*running_e + 0.5*kv_e +
   0.5*tokens_e)``. Queueing is weighted highest: it is the signal that turns straight into
   time to first token.

3. Headroom, relative to the least-loaded replica of the pool::

       raw_e    = 1 - (1 - floor) * load_e
       factor_e = max(floor, raw_e / max_j raw_j)

   so when the whole pool is equally busy, weights do not move at all.

4. Quantized with hysteresis: the factor moves only when ``factor_e`` is more than ``band``
   away from the endpoint's current factor, and then to the nearest multiple of ``step``. Noise within the band
   changes nothing, so no push and no ring churn.

5. ``weight_e = max(1, round(static_weight_e * factor_e))``.

An endpoint without telemetry, or whose telemetry is older than ``max_age``, gets factor 1:
its static weight, neutral, never zero.

Degraded (pools without session affinity)
-----------------------------------------
A replica is saturated when ``waiting / c >= queue_saturated`` or ``kv_cache >=
kv_saturated``; a saturated healthy replica is reported to Envoy as DEGRADED. Envoy then sends
it traffic only when the healthy hosts lack capacity, so new work goes elsewhere. It stays degraded until it drops below both recovery bounds
(``recover_queue`` times the queue bound, ``recover_kv`` KV-cache use: hysteresis again). At
most ``max_degraded_fraction`` of a pool's endpoints (the most loaded first) are degraded at
once, so a busy pool never degrades itself into panic mode.
Static health (unhealthy, draining) always wins over telemetry.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.models import TELEMETRY_MAX_AGE, Endpoint
from signals.telemetry import TelemetryRecord


@dataclass(frozen=True, slots=True)
class WeightParams:
    """Knobs of the weight function; the defaults suit a pool of similar LLM replicas."""

    max_age: float = TELEMETRY_MAX_AGE
    """Telemetry older than this (seconds) is ignored: neutral weight."""
    queue_ref: float = 8.0
    """Queued requests per unit of capacity below which the queue signal stays partial."""
    running_ref: float = 32.0
    """Running requests per unit of capacity that count as a full batch when the batch size
    is unknown."""
    tokens_ref: float = 16384.0
    """Pending tokens per unit of capacity below which the token signal stays partial."""
    floor: float = 0.1
    """Smallest factor: a loaded replica keeps at least this share of its static weight."""
    step: float = 0.1
    """Quantization step of the factor."""
    band: float = 0.15
    """Hysteresis: the factor moves only when the new value is further than this away."""
    queue_saturated: float = 32.0
    """Queued requests per unit of capacity at which a replica is marked degraded."""
    kv_saturated: float = 0.97
    """KV-cache use at which a replica is marked degraded."""
    recover_queue: float = 0.5
    """A degraded replica recovers only below this fraction of ``queue_saturated`` ..."""
    recover_kv: float = 0.9
    """... and below this KV-cache use."""
    max_degraded_fraction: float = 0.5
    """At most this share of a pool's endpoints is degraded at once."""
    capacity_levels: tuple[float, ...] = (1.0, 0.7, 0.5, 0.35, 0.25)
    """Capacity factors a pool behind session affinity may take, largest first (about 1.4x
    apart: a coarse ladder, so noise never moves the hash ring)."""
    capacity_band: float = 0.65
    """A replica counts as slower than its level below this share of it."""
    capacity_rise: float = 0.9
    """A replica counts as fit for the next level up at this share of it or faster."""
    capacity_confirm: int = 2
    """Consecutive records that must agree before the capacity factor moves."""
    prefill_busy: float = 2.0
    """A record whose prompt tokens prefilled per output token are above this multiple of
    the pool's median (``prefill_floor`` at least) is no evidence of speed either way: its
    steps carried prompts the others did not (a burst of new documents)."""
    prefill_floor: float = 0.5
    """The least pool median ``prefill_busy`` is taken of: in a pool whose prompts are all
    cached a few tokens of a question are not a burst."""
    busy_throughput: float = 1.5
    """A record whose tokens a second (running sequences over TPOT) are at least this
    multiple of the pool's median is no evidence of a fall: the replica is busier than the
    others, not slower (its steps hold more sequences)."""


SIGNAL_WEIGHTS = {"queue": 1.0, "running": 0.5, "kv": 0.5, "tokens": 0.5}
"""How much each normalized signal adds to the load score (step 2 of the formula)."""


@dataclass(frozen=True, slots=True)
class WeightDecision:
    """What telemetry decided for one endpoint; kept between rounds for hysteresis."""

    weight: int
    """Load-balancing weight sent to Envoy."""
    factor: float
    """Quantized share of the static weight, ``floor`` to 1; 1 is neutral."""
    degraded: bool = False
    """Report the endpoint to Envoy as DEGRADED."""
    load: float | None = None
    """Load score in [0, 1]; ``None`` when telemetry is missing or stale."""
    age: float | None = None
    """Seconds since the telemetry was scraped; ``None`` when there is none."""
    speed: float | None = None
    """Capacity weights: the last record's speed relative to the pool (1 = the median)."""
    seen_at: float | None = None
    """Capacity weights: ``at`` of the last record counted, so a record counts once however
    often the pool is recompiled."""
    streak: int = 0
    """Capacity weights: consecutive records below (negative) or above (positive) the band."""

    @property
    def neutral(self) -> bool:
        """True when no fresh telemetry shaped this decision."""
        return self.load is None


def _relative(
    values: Mapping[str, float], caps: Mapping[str, float], ref: float
) -> dict[str, float]:
    per_cap = {key: value / caps[key] for key, value in values.items()}
    scale = max([ref, *per_cap.values()])
    return {key: min(1.0, value / scale) for key, value in per_cap.items()}


def _quantize(value: float, step: float, floor: float) -> float:
    # Round half up, then to a few decimals so 0.1 steps do not drift (0.30000000000000004).
    return round(max(floor, min(1.0, math.floor(value / step + 0.5) * step)), 6)


def pool_weights(
    endpoints: Sequence[Endpoint],
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float,
    previous: Mapping[str, WeightDecision] | None = None,
    params: WeightParams | None = None,
    affinity: bool = False,
) -> dict[str, WeightDecision]:
    """Weights and health for every endpoint of one pool, keyed by ``Endpoint.key``.

    ``telemetry`` and ``previous`` are keyed by ``Endpoint.key`` (``address:port``) too;
    ``previous`` is what this function returned last time (empty on the first round).
    ``now`` is wall-clock seconds, the clock of ``TelemetryRecord.at``.
    """
    params = params or WeightParams()
    previous = previous or {}
    if affinity:
        return capacity_weights(endpoints, telemetry, now=now, previous=previous, params=params)
    step, band = params.step, params.band
    static = {endpoint.key: endpoint for endpoint in endpoints}
    if not static:
        return {}
    mean_weight = sum(e.weight for e in endpoints) / len(endpoints)
    caps = {key: e.weight / mean_weight for key, e in static.items()}

    ages: dict[str, float] = {}
    fresh: dict[str, TelemetryRecord] = {}
    for key in static:
        record = telemetry.get(key)
        if record is None:
            continue
        ages[key] = max(0.0, now - record.at)
        if ages[key] <= params.max_age:
            fresh[key] = record

    def signal(name: str) -> dict[str, float]:
        return {
            key: value
            for key, record in fresh.items()
            if (value := getattr(record, name)) is not None
        }

    queue = _relative(signal("waiting"), caps, params.queue_ref)
    tokens = _relative(signal("pending_tokens"), caps, params.tokens_ref)
    running_counts = signal("running")
    running = _relative(
        {k: v for k, v in running_counts.items() if fresh[k].max_running is None},
        caps,
        params.running_ref,
    )
    for key, value in running_counts.items():
        batch = fresh[key].max_running
        if batch is not None:
            running[key] = min(1.0, value / batch)
    kv = {key: min(1.0, value) for key, value in signal("kv_cache").items()}

    load = {
        key: min(
            1.0,
            SIGNAL_WEIGHTS["queue"] * queue.get(key, 0.0)
            + SIGNAL_WEIGHTS["running"] * running.get(key, 0.0)
            + SIGNAL_WEIGHTS["kv"] * kv.get(key, 0.0)
            + SIGNAL_WEIGHTS["tokens"] * tokens.get(key, 0.0),
        )
        for key in fresh
    }
    raw = {key: 1.0 - (1.0 - params.floor) * value for key, value in load.items()}
    best = max(raw.values(), default=1.0)

    saturated = _saturated(fresh, caps, previous, params)
    out: dict[str, WeightDecision] = {}
    for key, endpoint in static.items():
        if key not in fresh:
            out[key] = WeightDecision(weight=endpoint.weight, factor=1.0, age=ages.get(key))
            continue
        target = max(params.floor, raw[key] / best)
        before = previous.get(key)
        current = before.factor if before is not None and not before.neutral else 1.0
        factor = current if abs(target - current) <= band else _quantize(target, step, params.floor)
        out[key] = WeightDecision(
            weight=max(1, round(endpoint.weight * factor)),
            factor=factor,
            degraded=key in saturated and endpoint.health == "healthy",
            load=round(load[key], 6),
            age=ages[key],
        )
    return out


def capacity_weights(
    endpoints: Sequence[Endpoint],
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float,
    previous: Mapping[str, WeightDecision],
    params: WeightParams,
) -> dict[str, WeightDecision]:
    """Weights for a pool behind session affinity: static weight times a capacity factor
    learned from speed (see the module docstring). Keyed and called like `pool_weights`."""
    fresh: dict[str, TelemetryRecord] = {}
    ages: dict[str, float] = {}
    for endpoint in endpoints:
        record = telemetry.get(endpoint.key)
        if record is not None:
            ages[endpoint.key] = max(0.0, now - record.at)
            if ages[endpoint.key] <= params.max_age:
                fresh[endpoint.key] = record
    tpots = {
        key: record.time_per_output_token
        for key, record in fresh.items()
        if record.time_per_output_token is not None
    }
    reference = _pool_reference(tpots, len(fresh))
    medians = {
        key: record.median_time_per_output_token
        for key, record in fresh.items()
        if record.median_time_per_output_token is not None
    }
    typical_reference = _pool_reference(medians, len(fresh))
    prefills = {
        key: record.prefill_per_token
        for key, record in fresh.items()
        if record.prefill_per_token is not None
    }
    prefill_reference = _pool_reference(prefills, len(fresh))
    busy_above = (
        None
        if prefill_reference is None
        else params.prefill_busy * max(prefill_reference, params.prefill_floor)
    )
    # Tokens a second per unit of static weight: a replica given twice the weight is given
    # twice the sessions.
    static = {endpoint.key: endpoint.weight for endpoint in endpoints}
    mean_weight = sum(static.values()) / len(static) if static else 1.0
    throughputs = {
        key: record.running / tpot / (static[key] / mean_weight)
        for key, record in fresh.items()
        if record.running and (tpot := tpots.get(key)) is not None and static[key] > 0
    }
    throughput_reference = _pool_reference(throughputs, len(fresh))
    busier_above = (
        None if throughput_reference is None else params.busy_throughput * throughput_reference
    )
    levels = sorted(params.capacity_levels, reverse=True)
    out: dict[str, WeightDecision] = {}
    for endpoint in endpoints:
        key = endpoint.key
        record = fresh.get(key)
        if record is None:
            out[key] = WeightDecision(weight=endpoint.weight, factor=1.0, age=ages.get(key))
            continue
        before = previous.get(key)
        factor = before.factor if before is not None and not before.neutral else 1.0
        speed = before.speed if before is not None else None
        streak = before.streak if before is not None else 0
        seen_at = before.seen_at if before is not None else None
        tpot = tpots.get(key)
        if reference is not None and tpot is not None and record.at != seen_at:
            speed, seen_at = reference / tpot, record.at
            higher = [level for level in levels if level > factor]
            median = medians.get(key)
            slower = speed < factor * params.capacity_band
            rise_to = min(higher) * params.capacity_rise if higher else None
            # What the median says the replica's speed is: the mean is not enough alone. A
            # replica busy with long prompts has a high mean TPOT at full speed (it must not
            # fall), and the others' long prefill steps inflate the pool's reference, so a
            # half-speed replica can look fast (it must not rise).
            prefill = prefills.get(key)
            median_says: bool | None
            if busy_above is not None and prefill is not None and prefill > busy_above:
                # Busy, not slow: its steps carried prompts the pool's did not. No evidence
                # either way; a run of slow records goes on past it.
                median_says = None
            elif slower and busier_above is not None and throughputs.get(key, 0) >= busier_above:
                # Busier, not slower: more sequences per step, more tokens a second than the
                # pool's. No evidence of a fall; the run goes on past it.
                median_says = None
            elif not medians:
                # No medians in the pool (a server without the histogram): the mean alone.
                median_says = slower or (rise_to is not None and speed >= rise_to)
            elif not slower and (rise_to is None or speed < rise_to):
                median_says = False
            elif median is None or typical_reference is None:
                median_says = None  # too few tokens for one: no evidence either way
            elif slower:
                median_says = typical_reference / median < params.capacity_band
            else:
                median_says = typical_reference / median >= (rise_to or 0.0)
            if median_says is None:
                pass
            elif median_says and slower:
                streak = min(streak, 0) - 1
            elif median_says:
                streak = max(streak, 0) + 1
            else:
                streak = 0
            if streak <= -params.capacity_confirm:
                # Straight to the level nearest the last speed (log scale): one ring change.
                lower = [level for level in levels if level < factor] or [factor]
                factor = min(lower, key=lambda level: abs(math.log(level / speed)))
                streak = 0
            elif streak >= params.capacity_confirm:
                # Up one level at a time: sessions return to a recovered replica gradually.
                factor = min(higher, default=factor)
                streak = 0
        out[key] = WeightDecision(
            weight=max(1, round(endpoint.weight * factor)),
            factor=factor,
            load=0.0,
            age=ages[key],
            speed=None if speed is None else round(speed, 4),
            seen_at=seen_at,
            streak=streak,
        )
    return out


def _pool_reference(values: Mapping[str, float], fresh: int) -> float | None:
    """The pool's median of `values` (times per output token by endpoint), or ``None``
    unless more than half of the `fresh` endpoints gave one (and at least two): as a pool
    drains, the slowest replicas are the last still decoding, and a median of those alone
    would make a half-speed replica the pool's norm and give it its full share back."""
    if len(values) < 2 or 2 * len(values) <= fresh:
        return None
    return statistics.median(values.values())


def _saturated(
    fresh: Mapping[str, TelemetryRecord],
    caps: Mapping[str, float],
    previous: Mapping[str, WeightDecision],
    params: WeightParams,
) -> set[str]:
    """Endpoints to mark degraded: over a bound (or not yet recovered), most loaded first,
    capped at ``max_degraded_fraction`` of the pool."""
    pressure: dict[str, float] = {}
    for key, record in fresh.items():
        queue = (record.waiting or 0.0) / caps[key] / params.queue_saturated
        kv = (record.kv_cache or 0.0) / params.kv_saturated
        was = previous.get(key)
        if was is not None and was.degraded:
            over = queue >= params.recover_queue or kv >= params.recover_kv / params.kv_saturated
        else:
            over = queue >= 1.0 or kv >= 1.0
        if over:
            pressure[key] = max(queue, kv)
    allowed = math.floor(len(caps) * params.max_degraded_fraction)
    ranked = sorted(pressure, key=lambda key: (-pressure[key], key))
    return set(ranked[:allowed])


__all__ = [
    "SIGNAL_WEIGHTS",
    "WeightDecision",
    "WeightParams",
    "capacity_weights",
    "pool_weights",
]
