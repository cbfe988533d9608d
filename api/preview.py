"""Objects -> the Envoy resources they produce, as JSON. Pure: no etcd, no server.

Used by ``?dryRun=true`` on the REST API (the stored objects plus the proposed change) and by
``kvpilot translate`` (objects read from files).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from compiler import RoutingPlan, compile_plan
from signals import PolicyState
from xdsserver import resources
from xdsserver.snapshot import Snapshot
from xdsserver.translate import FleetResources, translate

RESOURCE_KEYS = ("clusters", "endpoints", "listeners", "routes")
"""The four resource lists of a fleet, in make-before-break order (CDS, EDS, LDS, RDS)."""
_TYPE_URLS = (resources.CLUSTER, resources.ENDPOINT, resources.LISTENER, resources.ROUTE)


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


def preview(state: PolicyState, *, fleet: str | None = None) -> dict[str, Any]:
    """Compile and translate ``state``: what Envoys would be sent."""
    return plan_json(compile_plan(state), fleet=fleet)


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
