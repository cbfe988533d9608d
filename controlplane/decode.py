"""etcd values -> policy objects: the one reading of what kvpilot keeps in etcd.

The reconciler (the state the daemon serves) and the REST API's dry run (the state a change
would produce) both decode through here, so the two cannot disagree on what a value means or
on whether it is valid. Pure: keys and bytes in, validated objects out.

A key is relative to the store's prefix (``objects/pools/a``, ``endpoints/pool/id``,
``telemetry/pool/id``; see ``controlplane.store``). Keys of other sections (Envoy status
records) are not policy state and decode to nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from controlplane.store import ENDPOINTS, OBJECTS, TELEMETRY
from policies import PATH_KINDS, Endpoint, PolicyError, PolicyObject, PolicyState, parse_object
from policies.telemetry import TelemetryRecord
from policies.weights import WeightDecision

Decoded = PolicyObject | Endpoint | TelemetryRecord


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
            obj = parse_object(json.loads(value), source=key)
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


@dataclass
class DecodedState:
    """The valid objects, registered endpoints and telemetry records among etcd's keys, by
    relative key, kept current one key at a time."""

    objects: dict[str, PolicyObject] = field(default_factory=dict)
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    telemetry: dict[str, TelemetryRecord] = field(default_factory=dict)

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
        self.endpoints.pop(key, None)
        self.telemetry.pop(key, None)
        if isinstance(decoded, Endpoint):
            self.endpoints[key] = decoded
        elif isinstance(decoded, TelemetryRecord):
            self.telemetry[key] = decoded
        elif decoded is not None:
            self.objects[key] = decoded

    def policy_state(
        self,
        *,
        previous_weights: Mapping[str, Mapping[str, WeightDecision]] | None = None,
        now: float = 0.0,
    ) -> PolicyState:
        """What compilation takes: the objects, endpoints by pool and telemetry by pool."""
        registered: dict[str, dict[str, Endpoint]] = {}
        for key, endpoint in self.endpoints.items():
            pool, endpoint_id = _pool_and_id(key)
            registered.setdefault(pool, {})[endpoint_id] = endpoint
        telemetry: dict[str, dict[str, TelemetryRecord]] = {}
        for key, record in self.telemetry.items():
            pool, endpoint_id = _pool_and_id(key)
            telemetry.setdefault(pool, {})[endpoint_id] = record
        return PolicyState.from_objects(
            self.objects.values(),
            registered=registered,
            telemetry=telemetry,
            previous_weights=previous_weights or {},
            now=now,
        )
