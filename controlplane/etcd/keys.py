"""kvpilot's data in etcd: the key layout, the keys' names, and how values are encoded
(the store that reads and writes them is ``controlplane.etcd.store``).

Key layout
----------

Every key lives under one prefix, ``/kvpilot`` by default (``kvpilot serve --etcd-prefix``), so several
kvpilot installations can share an etcd cluster. Values are JSON.

=============================================  =============================================
key                                            value
=============================================  =============================================
``{prefix}/objects/{kind}/{name}``             a declarative object, in its envelope
                                               ``{"apiVersion": "kvpilot.io/v1", "kind": ...,
                                               "metadata": {"name": ...}, "spec": {...}}``;
                                               ``{kind}`` is the lowercase plural
                                               (``pools``, ``routingpolicies``, ``fleets``)
``{prefix}/endpoints/{pool}/{endpoint_id}``    a registered backend endpoint (address, port,
                                               weight, ...); under a lease when the backend
                                               registers itself with a TTL
``{prefix}/telemetry/{pool}/{endpoint_id}``    the endpoint's latest telemetry record, under
                                               the reporting agent's lease
``{prefix}/status/envoys/{replica}/{node_id}`` an Envoy's connection status as seen by one
                                               control-plane replica, under that replica's
                                               lease (gone when the replica is)
``{prefix}/status/rests/{replica}/{pool}``     when a paid pool's rest after a 429 ends, as
                                               one replica learned it, under a lease that
                                               ends with the rest (``controlplane.rests``)
``{prefix}/status/arrivals/{replica}/{route}`` a fleet's arrival rate on a route cluster
                                               (``{route}`` is ``fleet/cluster``, its ``/``
                                               escaped) as one replica's Envoys report it,
                                               written when it moves, under the replica's
                                               lease (``controlplane.arrivals``)
``{prefix}-audit/{revision}-{random}``         one audit entry (``controlplane.audit``);
                                               beside the prefix, not under it, so the
                                               daemon's mirror never loads the log
=============================================  =============================================

Names (object names, pools, endpoint ids, replica and node ids) are single key segments: no
``/``, not empty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from controlplane.etcd import EtcdError, KeyValue
from policies import KIND_PATHS, jsondoc, kind_named

DEFAULT_PREFIX = "/kvpilot"

OBJECTS = "objects"
ENDPOINTS = "endpoints"
TELEMETRY = "telemetry"
STATUS = "status"


class StoreError(EtcdError):
    """A store operation failed in a way the caller can fix."""


class InvalidName(StoreError, ValueError):
    """A name cannot be used as a key segment."""


class UnknownKind(StoreError, ValueError):
    """The kind has no key path."""


class ValueTooLarge(StoreError):
    """A value is larger than etcd accepts in one request."""


def decode_json(kv: KeyValue | bytes) -> dict[str, Any] | None:
    """The value as a JSON object, or ``None`` if it is not one (or is nested too deeply)."""
    raw = kv if isinstance(kv, bytes) else kv.value
    try:
        value = jsondoc.loads(raw)
    except jsondoc.JsonError:
        return None
    return value if isinstance(value, dict) else None


MAX_VALUE_BYTES = 1_500_000
"""Largest value written: etcd refuses requests over --max-request-bytes (1.5 MiB by default,
key and framing included)."""


def encode_json(body: Mapping[str, Any]) -> bytes:
    """Compact JSON; ``ValueTooLarge`` over `MAX_VALUE_BYTES`."""
    value = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    if len(value) > MAX_VALUE_BYTES:
        raise ValueTooLarge(
            f"the object is {len(value):,} bytes stored, over the {MAX_VALUE_BYTES:,} bytes etcd "
            "accepts in one value; split it"
        )
    return value


def _segment(value: str, what: str) -> str:
    if not value or "/" in value or value in (".", "..") or not value.isprintable():
        raise InvalidName(
            f"{what} {value!r} cannot be used: it must be non-empty, printable, and contain no '/'"
        )
    return value


def _normalize_prefix(prefix: str) -> str:
    prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
    if not prefix:
        raise ValueError("the etcd key prefix must not be empty or '/'")
    return prefix


class Keys:
    """Key construction and parsing for one prefix; relative keys omit ``{prefix}/``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = _normalize_prefix(prefix)

    @property
    def root(self) -> bytes:
        """The watched prefix, with its trailing slash."""
        return (self.prefix + "/").encode()

    def kind_path(self, kind: str) -> str:
        """``"Pool"`` or ``"pools"`` -> ``"pools"``."""
        return KIND_PATHS[self.kind_name(kind)]

    def kind_name(self, kind: str) -> str:
        """``"pools"`` or ``"Pool"`` -> ``"Pool"`` (``policies.kind_named``)."""
        found = kind_named(kind)
        if found is None:
            known = ", ".join(sorted(KIND_PATHS))
            raise UnknownKind(f"unknown kind {kind!r}; known kinds: {known}")
        return found

    def absolute(self, relative: str) -> bytes:
        return f"{self.prefix}/{relative}".encode()

    def relative(self, key: bytes) -> str:
        return key[len(self.root) :].decode(errors="backslashreplace")

    def object(self, kind: str, name: str) -> str:
        return f"{OBJECTS}/{self.kind_path(kind)}/{_segment(name, 'name')}"

    def objects(self, kind: str) -> str:
        return f"{OBJECTS}/{self.kind_path(kind)}/"

    def endpoints(self, pool: str) -> str:
        return f"{ENDPOINTS}/{_segment(pool, 'pool')}/"

    def endpoint(self, pool: str, endpoint_id: str) -> str:
        return f"{ENDPOINTS}/{_segment(pool, 'pool')}/{_segment(endpoint_id, 'endpoint id')}"

    def telemetry(self, pool: str, endpoint_id: str) -> str:
        return f"{TELEMETRY}/{_segment(pool, 'pool')}/{_segment(endpoint_id, 'endpoint id')}"

    def envoy_status(self, replica_id: str, node_id: str) -> str:
        return (
            f"{STATUS}/envoys/{_segment(replica_id, 'replica id')}/{_segment(node_id, 'node id')}"
        )
