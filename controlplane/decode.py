"""etcd values -> policy objects: the one reading of what kvpilot keeps in etcd.

The reconciler (the state the daemon serves) and the REST API's dry run (the state a change
would produce) both decode through here, so the two cannot disagree on what a value means or
on whether it is valid. Pure: keys and bytes in, validated objects out.

A key is relative to the store's prefix (``objects/pools/a``, ``endpoints/pool/id``,
``telemetry/pool/id``; see ``controlplane.etcd.keys``). Keys of other sections (Envoy status
records) are not policy state and decode to nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar

from controlplane.etcd.keys import ENDPOINTS, OBJECTS, TELEMETRY
from policies import (
    PATH_KINDS,
    Endpoint,
    PolicyError,
    PolicyObject,
    RoutingPolicy,
    jsondoc,
    parse_object,
)
from signals import PolicyState
from signals.admission import AdmissionDecision
from signals.difficultyshare import ShareDecision
from signals.overflow import OverflowDecision
from signals.overflowwork import KindWork, Work
from signals.prefillrecord import StoredFit
from signals.saturation import SaturationDecision
from signals.spill import SpillDecision
from signals.telemetry import TelemetryRecord
from signals.weights import WeightDecision

Decoded = PolicyObject | Endpoint | TelemetryRecord
_V = TypeVar("_V", Endpoint, TelemetryRecord)


class DecodeError(ValueError):
    """A value in etcd that is not a valid object for its key; ``str()`` says why."""


def decode(key: str, value: bytes) -> Decoded | None:
    """The object a relative `key` holds, or None for a key that holds no policy state.
    `DecodeError` when the value does not validate, or names another object than its key."""
    parts = key.split("/")
    if len(parts) != 3:
        return None
    section, group, name = parts
    try:
        if section == OBJECTS:
            obj = parse_object(jsondoc.loads(value), source=key)
            if PATH_KINDS.get(group) != obj.kind or obj.metadata.name != name:
                raise PolicyError(
                    [],
                    f"{key}: holds {obj.kind} {obj.metadata.name!r}, not a {PATH_KINDS.get(group)} named {name!r}",
                )
            return obj
        if section == ENDPOINTS:
            return Endpoint.model_validate_json(value)
        if section == TELEMETRY:
            return TelemetryRecord.model_validate_json(value)
    except (ValueError, PolicyError) as error:
        raise DecodeError(str(error)) from None
    return None


def _pool_and_id(key: str) -> tuple[str, str]:
    _, pool, endpoint_id = key.split("/")
    return pool, endpoint_id


class _ByPool(Generic[_V]):
    """Entries of one section filed by pool, with a frozen copy of each pool's entries that is
    made again only after that pool changed. Compilation reuses what it built for a pool whose
    mapping is the same object as last time, so a change costs what it touches, not the fleet."""

    def __init__(self) -> None:
        self._live: dict[str, dict[str, _V]] = {}
        self._frozen: dict[str, Mapping[str, _V]] = {}

    def put(self, key: str, value: _V) -> None:
        pool, endpoint_id = _pool_and_id(key)
        self._live.setdefault(pool, {})[endpoint_id] = value
        self._frozen.pop(pool, None)

    def remove(self, key: str) -> None:
        pool, endpoint_id = _pool_and_id(key)
        entries = self._live.get(pool, {})
        entries.pop(endpoint_id, None)
        if not entries:
            self._live.pop(pool, None)
        self._frozen.pop(pool, None)

    def frozen(self) -> dict[str, Mapping[str, _V]]:
        """Pool -> endpoint id -> entry; a pool's mapping is the same object until it changes."""
        for pool, entries in self._live.items():
            if pool not in self._frozen:
                self._frozen[pool] = MappingProxyType(dict(entries))
        return dict(self._frozen)


@dataclass
class DecodedState:
    """The valid objects, registered endpoints and telemetry records among etcd's keys, by
    relative key, kept current one key at a time."""

    objects: dict[str, PolicyObject] = field(default_factory=dict)
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    telemetry: dict[str, TelemetryRecord] = field(default_factory=dict)
    _registered: _ByPool[Endpoint] = field(default_factory=_ByPool, repr=False)
    _telemetry_by_pool: _ByPool[TelemetryRecord] = field(default_factory=_ByPool, repr=False)

    @classmethod
    def from_values(cls, values: Mapping[str, bytes]) -> DecodedState:
        """The state of `values` (relative key -> value); what does not decode is left out."""
        state = cls()
        for key, value in values.items():
            try:
                state.apply(key, value)
            except DecodeError:
                continue
        return state

    def holds(self, key: str) -> bool:
        """True when `key` has a valid value in this state."""
        return key in self.objects or key in self.endpoints or key in self.telemetry

    def apply(self, key: str, value: bytes | None) -> None:
        """Take `key`'s new value (None: deleted). `DecodeError` when it does not decode; the
        key's last valid value then stays."""
        decoded = decode(key, value) if value is not None else None
        self.objects.pop(key, None)
        if self.endpoints.pop(key, None) is not None:
            self._registered.remove(key)
        if self.telemetry.pop(key, None) is not None:
            self._telemetry_by_pool.remove(key)
        if isinstance(decoded, Endpoint):
            self.endpoints[key] = decoded
            self._registered.put(key, decoded)
        elif isinstance(decoded, TelemetryRecord):
            self.telemetry[key] = decoded
            self._telemetry_by_pool.put(key, decoded)
        elif decoded is not None:
            self.objects[key] = decoded

    def gates_auto(self) -> bool:
        """True when a routing policy has a route with ``overflow.maxInFlight: auto``: the
        only reader of the Envoys connected per fleet."""
        return any(
            route.overflow is not None and route.overflow.max_in_flight == "auto"
            for obj in self.objects.values()
            if isinstance(obj, RoutingPolicy)
            for route in obj.spec.routes
        )

    def overflows_by_arrivals(self) -> bool:
        """True when a routing policy has a route with ``overflow.signal: arrivals``: the
        only reader of the usage log's work windows (``xdsserver.work``)."""
        return any(
            route.overflow is not None and route.overflow.signal == "arrivals"
            for obj in self.objects.values()
            if isinstance(obj, RoutingPolicy)
            for route in obj.spec.routes
        )

    def policy_state(
        self,
        *,
        previous_weights: Mapping[str, Mapping[str, WeightDecision]] | None = None,
        previous_admission: Mapping[str, AdmissionDecision] | None = None,
        previous_saturation: Mapping[str, SaturationDecision] | None = None,
        difficulty: Mapping[str, ShareDecision] | None = None,
        previous_spill: Mapping[str, SpillDecision] | None = None,
        previous_overflow: Mapping[str, OverflowDecision] | None = None,
        now: float = 0.0,
        provider_backoff: Mapping[str, float] | None = None,
        arrivals: Mapping[str, float] | None = None,
        envoys: Mapping[str, int] | None = None,
        service_times: Mapping[str, float] | None = None,
        completions: Mapping[str, float] | None = None,
        recent_completions: Mapping[str, float] | None = None,
        session_shares: Mapping[str, float] | None = None,
        recent_demands: Mapping[str, float] | None = None,
        recent_work: Mapping[str, Work] | None = None,
        completed_work: Mapping[str, Work] | None = None,
        kind_work: Mapping[str, KindWork] | None = None,
        prefill_per_output: Mapping[str, float] | None = None,
        stored_fits: Mapping[str, StoredFit] | None = None,
    ) -> PolicyState:
        """What compilation takes: the objects, endpoints by pool and telemetry by pool. The
        per-pool mappings are shared with this state and must not be changed."""
        return PolicyState.from_objects(
            self.objects.values(),
            registered=self._registered.frozen(),
            telemetry=self._telemetry_by_pool.frozen(),
            previous_weights=previous_weights or {},
            previous_admission=previous_admission or {},
            previous_saturation=previous_saturation or {},
            difficulty=difficulty or {},
            previous_spill=previous_spill or {},
            previous_overflow=previous_overflow or {},
            now=now,
            provider_backoff=provider_backoff or {},
            arrivals=arrivals or {},
            envoys=envoys or {},
            service_times=service_times or {},
            completions=completions or {},
            recent_completions=recent_completions or {},
            session_shares=session_shares or {},
            recent_demands=recent_demands or {},
            recent_work=recent_work or {},
            completed_work=completed_work or {},
            kind_work=kind_work or {},
            prefill_per_output=prefill_per_output or {},
            stored_fits=stored_fits or {},
        )
