"""What compilation reads: validated objects filed by kind plus the live inputs (registered
endpoints, telemetry, the previous compile's decisions), and a pool's endpoints as
compilation sees them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.models import Budget, Endpoint, Fleet, PolicyObject, Pool, Rollout, RoutingPolicy
from signals.admission import AdmissionDecision
from signals.difficultyshare import ShareDecision
from signals.overflow import OverflowDecision
from signals.overflowwork import KindWork, Work
from signals.prefillrecord import StoredFit
from signals.saturation import SaturationDecision
from signals.spill import SpillDecision
from signals.telemetry import TelemetryRecord
from signals.weights import WeightDecision


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Everything compilation needs, already validated."""

    pools: Mapping[str, Pool] = field(default_factory=dict)
    policies: Mapping[str, RoutingPolicy] = field(default_factory=dict)
    fleets: Mapping[str, Fleet] = field(default_factory=dict)
    registered: Mapping[str, Mapping[str, Endpoint]] = field(default_factory=dict)
    """Endpoints registered through the API or by agents: pool name -> endpoint id -> endpoint."""
    telemetry: Mapping[str, Mapping[str, TelemetryRecord]] = field(default_factory=dict)
    """Latest telemetry: pool name -> endpoint id (``address:port``) -> record."""
    previous_weights: Mapping[str, Mapping[str, WeightDecision]] = field(default_factory=dict)
    """``RoutingPlan.weights`` of the previous compile, for hysteresis."""
    previous_admission: Mapping[str, AdmissionDecision] = field(default_factory=dict)
    """``RoutingPlan.admission`` of the previous compile, for hysteresis."""
    previous_saturation: Mapping[str, SaturationDecision] = field(default_factory=dict)
    """``RoutingPlan.saturation`` of the previous compile, for hysteresis."""
    difficulty: Mapping[str, ShareDecision] = field(default_factory=dict)
    """Thresholds kvpilot learned for virtual models with a share: ``policy/name`` -> decision
    (``signals.difficultyshare``)."""
    previous_spill: Mapping[str, SpillDecision] = field(default_factory=dict)
    """``RoutingPlan.spill`` of the previous compile, for hysteresis."""
    previous_overflow: Mapping[str, OverflowDecision] = field(default_factory=dict)
    """``RoutingPlan.overflow`` of the previous compile, for hysteresis."""
    provider_backoff: Mapping[str, float] = field(default_factory=dict)
    """Paid pools resting after a 429: pool name -> wall-clock time its ``Retry-After`` ends
    (learned from Envoy's access log, ``xdsserver.signals``)."""
    envoys: Mapping[str, int] = field(default_factory=dict)
    """Envoys connected per fleet, to any kvpilot replica (their status records in etcd):
    ``overflow.maxInFlight: auto`` splits the batch slots over them."""
    arrivals: Mapping[str, float] = field(default_factory=dict)
    """Requests per second each fleet's Envoys started on each route cluster, over the last
    few seconds: ``fleet/cluster`` (``compiler.locality.spill_key``) -> rate (reported at each
    request's start over the access log service, ``xdsserver.arrivals``)."""
    service_times: Mapping[str, float] = field(default_factory=dict)
    """Mean seconds a streamed request spent being served (first to last byte from the
    replica) on each upstream host, ``address:port``, over its recent requests."""
    completions: Mapping[str, float] = field(default_factory=dict)
    """Answers completed per second on each upstream host, ``address:port``, over the last
    few seconds (from every fleet's arrivals log)."""
    recent_completions: Mapping[str, float] = field(default_factory=dict)
    """Answers completed per second on each upstream host, ``address:port``, over the last
    ``signals.overflowff.SAMPLE_WINDOW`` seconds: the capacity samples of overflow by
    arrivals."""
    recent_demands: Mapping[str, float] = field(default_factory=dict)
    """Route cluster -> requests per second this kvpilot replica's Envoys started on the
    route over the last few seconds alone (``ArrivalBook.recent_demands``): overflow by
    arrivals takes it over the shared rate when it is higher beyond noise
    (``signals.overflowff.blend_demand``), so a rise shows within seconds."""
    session_shares: Mapping[str, float] = field(default_factory=dict)
    """Route cluster (``policy/route``) -> share of the requests started on its own replicas
    that had a session (``xdsserver.arrivals.ArrivalBook.session_shares``)."""
    recent_work: Mapping[str, Work] = field(default_factory=dict)
    """Tokens completed per second on each upstream host, ``address:port``, over the last
    ``signals.overflowwork.SAMPLE_WINDOW`` seconds (output and uncached prompt tokens of the
    usage its responses carried, ``xdsserver.work``): overflow by arrivals' capacity samples
    in work, weighed with the route's learned prefill weight (``signals.prefillfit``)."""
    completed_work: Mapping[str, Work] = field(default_factory=dict)
    """The same over the long window (``xdsserver.arrivals.ARRIVAL_WINDOW``)."""
    prefill_per_output: Mapping[str, float] = field(default_factory=dict)
    """Each upstream host's uncached prompt tokens per output token over the long window:
    the prefill its responses needed per token made."""
    stored_fits: Mapping[str, StoredFit] = field(default_factory=dict)
    """Route cluster (``policy/route``) -> the prefill fit kvpilot stored in etcd for it
    (``controlplane.prefillfits``): a route whose fit is fresh continues from it
    (``signals.prefillrecord.seeded``)."""
    kind_work: Mapping[str, KindWork] = field(default_factory=dict)
    """Route cluster (``policy/route``) -> its responses over the long window by kind (with
    or without a session), every pool's, and their work: the demand in work."""
    now: float = 0.0
    """Wall-clock seconds that telemetry ages are measured against."""
    rollouts: Mapping[str, Rollout] = field(default_factory=dict)
    """Rollouts: their routes' listeners report every upstream attempt to kvpilot."""
    budgets: Mapping[str, Budget] = field(default_factory=dict)
    """Spend budgets of tenants."""
    over_budget: Mapping[str, float] = field(default_factory=dict)
    """Budgets whose current window is spent: budget name -> when the window ends (Unix
    time). Decided by kvpilot from the fleet's spend (``controlplane.reconcile.budgets``)."""

    @classmethod
    def from_objects(cls, objects: Iterable[PolicyObject], **live: Any) -> PolicyState:
        """File validated objects by kind (a later object replaces an earlier one of the same
        kind and name); ``live`` gives the other fields (registered endpoints, telemetry...)."""
        by_kind: dict[type[PolicyObject], dict[str, Any]] = {
            Pool: {},
            RoutingPolicy: {},
            Fleet: {},
            Rollout: {},
            Budget: {},
        }
        for obj in objects:
            by_kind[type(obj)][obj.metadata.name] = obj
        return cls(
            pools=by_kind[Pool],
            policies=by_kind[RoutingPolicy],
            fleets=by_kind[Fleet],
            rollouts=by_kind[Rollout],
            budgets=by_kind[Budget],
            **live,
        )


def is_external(pool: Pool) -> bool:
    """An external provider pool (``PoolSpec.external``): TLS or DNS-named endpoints."""
    return pool.spec.external


def pool_endpoints(pool: Pool, registered: Mapping[str, Endpoint]) -> list[Endpoint]:
    """Static endpoints of a pool plus registered ones; a registration overrides a static entry
    with the same address and port."""
    static = pool.spec.by_key
    if not registered:
        return list(static.values())
    merged = dict(static)
    for endpoint in registered.values():
        merged[endpoint.key] = endpoint
    return [merged[key] for key in sorted(merged)]
