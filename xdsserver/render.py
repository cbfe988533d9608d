"""Objects, endpoints, telemetry and a clock -> the Envoy resources they produce, as JSON.

Pure: no etcd, no server. The one rendering of what Envoys would be sent, shared by the golden
tests (``tests/golden``), ``kvpilot translate`` (objects and telemetry read from files) and the
REST API's dry run (the stored objects plus the proposed change), so what a reviewer reads in a
golden file, what a user sees offline and what the API previews cannot drift apart.

The input (`RenderInput`) is what compilation reads besides the objects: endpoints registered by
agents or the API, the telemetry records agents write to etcd, and ``now``, the clock telemetry
ages are measured against (a fixed ``now`` makes live weights, saturation and admission
deterministic). Telemetry files and golden inputs hold records by pool and endpoint id::

    telemetry:
      <pool>:
        <address:port>: {at: 1000.0, running: 12, waiting: 3, max_running: 16, ...}

Decisions with hysteresis (capacity weights behind session affinity, a saturated route's
dwell, admission steps) depend on the rounds before. ``history`` holds earlier rounds, each a
``now`` and the telemetry then; they are compiled oldest first, each handing its decisions to
the next, as the daemon's reconcile loop does, and the last round is ``now`` and ``telemetry``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from pydantic import ValidationError

from compiler import RoutingPlan, compile_plan
from policies import Endpoint, FieldError, PolicyError, PolicyObject, parse_object
from policies.validate import field_errors
from signals import PolicyState
from signals.admission import AdmissionDecision
from signals.saturation import SaturationDecision
from signals.spill import SpillDecision
from signals.telemetry import TelemetryRecord
from signals.weights import WeightDecision
from xdsserver import resources
from xdsserver.snapshot import Snapshot
from xdsserver.translate import FleetResources, translate

RESOURCE_KEYS = ("clusters", "endpoints", "listeners", "routes")
"""The four resource lists of a fleet, in make-before-break order (CDS, EDS, LDS, RDS)."""
_TYPE_URLS = (resources.CLUSTER, resources.ENDPOINT, resources.LISTENER, resources.ROUTE)

Telemetry = dict[str, dict[str, TelemetryRecord]]
"""Pool name -> endpoint id (``address:port``) -> the latest record, as in etcd."""
Registered = dict[str, dict[str, Endpoint]]
"""Pool name -> endpoint id (``address:port``) -> a registered endpoint."""


Decisions = tuple[
    Mapping[str, Mapping[str, WeightDecision]],
    Mapping[str, AdmissionDecision],
    Mapping[str, SaturationDecision],
    Mapping[str, SpillDecision],
]
"""A compile's live decisions (weights, admission, saturation, spill), handed to the next
one."""


@dataclass(frozen=True, slots=True)
class Round:
    """One earlier compile: its clock and the telemetry it read."""

    now: float
    telemetry: Telemetry = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RenderInput:
    """Everything a rendering reads: objects plus the live inputs the daemon would have."""

    objects: Sequence[PolicyObject] = ()
    endpoints: Registered = field(default_factory=dict)
    """Endpoints registered through the API or by agents, beside the pools' static ones."""
    telemetry: Telemetry = field(default_factory=dict)
    """The agents' latest records."""
    now: float = 0.0
    """Wall-clock seconds that telemetry ages are measured against."""
    history: Sequence[Round] = ()
    """Earlier rounds, oldest first, whose decisions the last one starts from."""

    def state(self) -> PolicyState:
        """What the last round's compilation takes: the decisions of the rounds in
        ``history`` (none without a history: a first round, as after a restart)."""
        previous: Decisions = ({}, {}, {}, {})
        for earlier in self.history:
            plan = compile_plan(self._state(earlier, previous))
            previous = (plan.weights, plan.admission, plan.saturation, plan.spill)
        return self._state(Round(now=self.now, telemetry=self.telemetry), previous)

    def _state(self, round_: Round, previous: Decisions) -> PolicyState:
        weights, admission, saturation, spill = previous
        return PolicyState.from_objects(
            self.objects,
            registered=self.endpoints,
            telemetry=round_.telemetry,
            now=round_.now,
            previous_weights=weights,
            previous_admission=admission,
            previous_saturation=saturation,
            previous_spill=spill,
        )


def message_json(message: Message) -> dict[str, Any]:
    """A proto as the JSON Envoy's own docs use (camelCase field names, ``@type`` on Anys)."""
    # MessageToDict gives OrderedDicts for Any fields; round-trip through JSON for plain dicts.
    result: dict[str, Any] = json.loads(json.dumps(MessageToDict(message)))
    return result


def resources_json(fleet_resources: FleetResources) -> dict[str, list[dict[str, Any]]]:
    """One fleet's resources: ``{"clusters": [...], "endpoints": [...], ...}``."""
    return {
        key: [message_json(message) for message in getattr(fleet_resources, key)]
        for key in RESOURCE_KEYS
    }


def plan_json(plan: RoutingPlan, *, fleet: str | None = None) -> dict[str, Any]:
    """Diagnostics plus every fleet's (or one fleet's) resources."""
    return {
        "diagnostics": [dataclasses.asdict(diagnostic) for diagnostic in plan.diagnostics],
        "fleets": {
            fleet_plan.fleet: resources_json(translate(fleet_plan))
            for fleet_plan in plan.fleets
            if fleet is None or fleet_plan.fleet == fleet
        },
    }


def render(state: PolicyState, *, fleet: str | None = None) -> dict[str, Any]:
    """Compile and translate ``state``: what Envoys would be sent, as ``plan_json``."""
    return plan_json(compile_plan(state), fleet=fleet)


def render_input(given: RenderInput, *, fleet: str | None = None) -> dict[str, Any]:
    """``render`` of objects with their endpoints, telemetry and clock."""
    return render(given.state(), fleet=fleet)


def _mapping(data: Any, path: str) -> Mapping[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise PolicyError([FieldError(path, "must be a mapping")])
    return data


def parse_telemetry(data: Any, *, path: str = "telemetry") -> Telemetry:
    """Records by pool and endpoint id, validated as the daemon validates what agents write;
    a bad one is a `PolicyError` naming its place (``telemetry.pool.10.0.0.1:8000.running``)."""
    out: Telemetry = {}
    errors: list[FieldError] = []
    for pool, records in _mapping(data, path).items():
        for endpoint_id, record in _mapping(records, f"{path}.{pool}").items():
            where = f"{path}.{pool}.{endpoint_id}"
            # Agents' records may carry fields of a newer version (ignored when read from
            # etcd); a file written by hand with a misspelt signal should not pass silently.
            unknown = sorted(set(_mapping(record, where)) - set(TelemetryRecord.model_fields))
            if unknown:
                errors.append(
                    FieldError(
                        f"{where}.{unknown[0]}",
                        "unknown telemetry field; known fields: "
                        + ", ".join(TelemetryRecord.model_fields),
                    )
                )
                continue
            try:
                out.setdefault(str(pool), {})[str(endpoint_id)] = TelemetryRecord.model_validate(
                    record
                )
            except ValidationError as error:
                errors.extend(
                    FieldError(f"{where}.{e.path}".rstrip("."), e.message)
                    for e in field_errors(error)
                )
    if errors:
        raise PolicyError(errors)
    return out


def parse_endpoints(data: Any, *, path: str = "endpoints") -> Registered:
    """Registered endpoints: pool name -> a list of endpoints, each filed by its
    ``address:port`` as the daemon files agents' registrations."""
    out: Registered = {}
    errors: list[FieldError] = []
    for pool, entries in _mapping(data, path).items():
        if not isinstance(entries, list):
            errors.append(FieldError(f"{path}.{pool}", "must be a list of endpoints"))
            continue
        for index, entry in enumerate(entries):
            try:
                endpoint = Endpoint.model_validate(entry)
            except ValidationError as error:
                errors.extend(
                    FieldError(f"{path}.{pool}[{index}].{e.path}".rstrip("."), e.message)
                    for e in field_errors(error)
                )
                continue
            out.setdefault(str(pool), {})[endpoint.key] = endpoint
    if errors:
        raise PolicyError(errors)
    return out


def newest_record(telemetry: Telemetry) -> float | None:
    """The time of the newest record: the clock to read a saved set of records at, so they
    are as fresh as when they were saved."""
    times = [record.at for records in telemetry.values() for record in records.values()]
    return max(times) if times else None


INPUT_KEYS = ("description", "now", "objects", "endpoints", "telemetry", "history")
"""The keys of a rendering input document (a golden test's ``in/<case>.yaml``)."""


def parse_render_input(data: Any, *, source: str = "") -> RenderInput:
    """A rendering input document: ``{description, now, objects: [...], endpoints: {pool:
    [...]}, telemetry: {pool: {id: record}}}``; every problem is reported at once."""
    if not isinstance(data, Mapping):
        raise PolicyError([FieldError("", "must be a mapping")], source)
    errors = [
        FieldError(str(key), f"unknown key; known keys: {', '.join(INPUT_KEYS)}")
        for key in data
        if key not in INPUT_KEYS
    ]
    now = _seconds(data.get("now", 0.0), "now", errors)
    objects: list[PolicyObject] = []
    documents = data.get("objects") or []
    if not isinstance(documents, list):
        errors.append(FieldError("objects", "must be a list of policy objects"))
        documents = []
    for index, document in enumerate(documents):
        try:
            objects.append(parse_object(document))
        except PolicyError as error:
            errors.extend(
                FieldError(f"objects[{index}].{e.path}".rstrip("."), e.message)
                for e in error.errors
            )
    endpoints: Registered = {}
    telemetry: Telemetry = {}
    try:
        endpoints = parse_endpoints(data.get("endpoints"))
    except PolicyError as error:
        errors.extend(error.errors)
    try:
        telemetry = parse_telemetry(data.get("telemetry"))
    except PolicyError as error:
        errors.extend(error.errors)
    history = _history(data.get("history"), errors)
    if errors:
        raise PolicyError(errors, source)
    return RenderInput(
        objects=objects, endpoints=endpoints, telemetry=telemetry, now=now, history=history
    )


def _seconds(value: Any, path: str, errors: list[FieldError]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        errors.append(FieldError(path, "must be a number of seconds (Unix time)"))
        return 0.0
    return float(value)


def _history(data: Any, errors: list[FieldError]) -> list[Round]:
    """``history: [{now, telemetry}, ...]``, oldest first."""
    if data is None:
        return []
    if not isinstance(data, list):
        errors.append(FieldError("history", "must be a list of rounds {now, telemetry}"))
        return []
    rounds = []
    for index, entry in enumerate(data):
        path = f"history[{index}]"
        if not isinstance(entry, Mapping) or set(entry) - {"now", "telemetry"}:
            errors.append(FieldError(path, "must be a mapping with now and telemetry"))
            continue
        now = _seconds(entry.get("now"), f"{path}.now", errors)
        try:
            telemetry = parse_telemetry(entry.get("telemetry"), path=f"{path}.telemetry")
        except PolicyError as error:
            errors.extend(error.errors)
            continue
        rounds.append(Round(now=now, telemetry=telemetry))
    return rounds


def _resource_name(key: str, resource: dict[str, Any]) -> str:
    # A ClusterLoadAssignment is named by its clusterName; the other three by name.
    return str(resource.get("clusterName" if key == "endpoints" else "name", ""))


def resource_changes(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """What differs between two ``plan_json(...)["fleets"]``: one entry per added, removed or
    changed resource, ``{fleet, type, name, change, before, after}``, in fleet, then
    make-before-break type order, then name order."""
    changes = []
    for fleet in sorted(before.keys() | after.keys()):
        for key in RESOURCE_KEYS:
            old = {_resource_name(key, r): r for r in before.get(fleet, {}).get(key, [])}
            new = {_resource_name(key, r): r for r in after.get(fleet, {}).get(key, [])}
            for name in sorted(old.keys() | new.keys()):
                was, now = old.get(name), new.get(name)
                if was == now:
                    continue
                change = "added" if was is None else "removed" if now is None else "changed"
                changes.append(
                    {
                        "fleet": fleet,
                        "type": key,
                        "name": name,
                        "change": change,
                        "before": was,
                        "after": now,
                    }
                )
    return changes


def snapshot_json(snapshot: Snapshot) -> dict[str, Any]:
    """A served snapshot: each type's version and resources (with their own versions)."""
    out: dict[str, Any] = {"versions": {}}
    for key, type_url in zip(RESOURCE_KEYS, _TYPE_URLS, strict=True):
        out["versions"][key] = snapshot.version(type_url)
        out[key] = [
            {"name": name, "version": resource.version, "resource": message_json(resource.message)}
            for name, resource in sorted(snapshot.resources(type_url).items())
        ]
    return out


__all__ = [
    "INPUT_KEYS",
    "RESOURCE_KEYS",
    "Registered",
    "RenderInput",
    "Round",
    "Telemetry",
    "message_json",
    "newest_record",
    "parse_endpoints",
    "parse_render_input",
    "parse_telemetry",
    "plan_json",
    "render",
    "render_input",
    "resource_changes",
    "resources_json",
    "snapshot_json",
]
