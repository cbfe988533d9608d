"""From live telemetry to endpoint weights and health (pure, no I/O).

Which routes use it
-------------------
Only routes with ``balancing: telemetry``. Every other mode keeps the static weights of the
pool (round robin, least request and random have their own notion of balance, and ``orca``
lets Envoy weigh hosts itself from per-response load reports). A telemetry route with
session affinity uses the same weights for its consistent-hash cluster (both clusters read one
ClusterLoadAssignment), quantized more coarsely, because every weight change moves part of
the hash ring and loses KV-cache locality.

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
   away from the endpoint's current factor, and then to the nearest multiple of ``step``
   (coarser ``affinity_step``/``affinity_band`` for affinity pools). Noise within the band
   changes nothing, so no push and no ring churn.

5. ``weight_e = max(1, round(static_weight_e * factor_e))``.

An endpoint without telemetry, or whose telemetry is older than ``max_age``, gets factor 1:
its static weight, neutral, never zero.

Degraded
--------
A replica is saturated when ``waiting / c >= queue_saturated`` or ``kv_cache >=
kv_saturated``; a saturated healthy replica is reported to Envoy as DEGRADED. Envoy then sends
it traffic only when the healthy hosts lack capacity, so new work goes elsewhere; in an
affinity cluster its sessions move to their ring neighbours and bounded load keeps that spill
from overloading them. It stays degraded until it drops below both recovery bounds
(``recover_queue`` times the queue bound, ``recover_kv`` KV-cache use: hysteresis again). At
most ``max_degraded_fraction`` of a pool's endpoints (the most loaded first) are degraded at
once, so a busy pool never degrades itself into panic mode.
Static health (unhealthy, draining) always wins over telemetry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.models import TELEMETRY_MAX_AGE, Endpoint
from policies.telemetry import TelemetryRecord


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
    affinity_step: float = 0.25
    """Quantization step for pools behind session affinity (ring churn costs cache hits)."""
    affinity_band: float = 0.3
    """Hysteresis band for pools behind session affinity."""
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
    step, band = (
        (params.affinity_step, params.affinity_band) if affinity else (params.step, params.band)
    )
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


__all__ = ["SIGNAL_WEIGHTS", "WeightDecision", "WeightParams", "pool_weights"]
