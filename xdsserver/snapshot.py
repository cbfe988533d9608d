"""Immutable snapshots of Envoy resources, and the per-fleet cache ADS streams watch.

A fleet is a group of Envoys that get the same configuration (by default the Envoy's
`node.cluster`). `SnapshotCache.set_snapshot` only swaps a reference and sets one
`asyncio.Event` per affected stream: a slow Envoy never holds up the caller or other Envoys, and a
stream that wakes late sends only the newest snapshot ("latest wins").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from xdsserver.resources import Resource, content_version, resource_name, type_url_of

_EMPTY: Mapping[str, Resource] = MappingProxyType({})


class Snapshot:
    """An immutable set of resources per type URL, each serialized once.

    A type that is present (even with no resources) has a non-empty version, and Envoys
    subscribed to it get answers. A type that is absent has version "" and Envoys asking for it
    wait, as they would for a control plane that has not decided yet.
    """

    __slots__ = ("_resources", "_versions")

    def __init__(self, resources: Mapping[str, Mapping[str, Resource]]) -> None:
        """Build from already serialized resources; prefer `from_messages`."""
        self._resources: dict[str, Mapping[str, Resource]] = {}
        self._versions: dict[str, str] = {}
        for type_url, by_name in resources.items():
            frozen = MappingProxyType(dict(by_name))
            for name, resource in frozen.items():
                if name != resource.name or resource.type_url != type_url:
                    raise ValueError(
                        f"resource {resource.name!r} ({resource.type_url}) is filed under "
                        f"{name!r} ({type_url})"
                    )
            self._resources[type_url] = frozen
            self._versions[type_url] = content_version(
                (name, resource.version) for name, resource in frozen.items()
            )

    @classmethod
    def from_messages(cls, messages: Mapping[str, Iterable[Any]]) -> Snapshot:
        """Serialize each message once. Raises ValueError on a duplicate name within a type
        or on a message whose type does not match the type URL it is listed under.

        The messages are kept (for status views) and must not be mutated afterwards.
        """
        return cls({type_url: _serialize(type_url, msgs) for type_url, msgs in messages.items()})

    def with_messages(
        self,
        type_url: str,
        messages: Iterable[Any],
        *,
        replace_all: bool,
        removed: Iterable[str] = (),
    ) -> Snapshot:
        """A new snapshot where only `type_url` changes; every other Resource is reused.

        `replace_all=True`: the type holds exactly `messages`. `replace_all=False`: `messages`
        are added or replace resources of the same name, and names in `removed` are dropped.
        This is the fast path for endpoint and weight changes: re-serialize the few changed
        ClusterLoadAssignments, not the whole configuration.
        """
        changed = _serialize(type_url, messages)
        if replace_all:
            merged = changed
        else:
            merged = dict(self._resources.get(type_url, _EMPTY))
            for name in removed:
                merged.pop(name, None)
            merged.update(changed)
        new = Snapshot({type_url: merged})
        # Every other type is shared as is: no copy, no re-hash.
        new._resources = {**self._resources, **new._resources}
        new._versions = {**self._versions, **new._versions}
        return new

    def types(self) -> tuple[str, ...]:
        """The type URLs present in this snapshot."""
        return tuple(self._resources)

    def resources(self, type_url: str) -> Mapping[str, Resource]:
        """Resources of one type by name (read-only; empty if the type is absent)."""
        return self._resources.get(type_url, _EMPTY)

    def version(self, type_url: str) -> str:
        """Content hash over the sorted (name, resource version) pairs of a type; "" if absent."""
        return self._versions.get(type_url, "")

    def versions(self) -> dict[str, str]:
        """Version per present type, for status views and logs."""
        return dict(self._versions)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return self._versions == other._versions

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._versions.items())))

    def __repr__(self) -> str:
        return f"Snapshot({self._versions!r})"


def _serialize(type_url: str, messages: Iterable[Any]) -> dict[str, Resource]:
    out: dict[str, Resource] = {}
    for message in messages:
        actual = type_url_of(message)
        if actual != type_url:
            raise ValueError(f"a {actual} was listed under {type_url}")
        name = resource_name(message)
        if name in out:
            raise ValueError(f"duplicate {type_url.rsplit('.', 1)[-1]} name {name!r}")
        out[name] = Resource.from_message(message)
    return out


class NodeFleet(Protocol):
    """Maps an Envoy's node (envoy.config.core.v3.Node) to the fleet whose snapshot it gets."""

    def __call__(self, node: Any) -> str: ...


class Watch:
    """One stream's wakeup: an event set on change and the time of the oldest unsent change.

    Holds no queue: however many snapshots are set while the stream is busy, it wakes once and
    reads the newest.
    """

    __slots__ = ("changed_at", "event", "fleet")

    def __init__(self, fleet: str) -> None:
        self.fleet = fleet
        self.event = asyncio.Event()
        self.changed_at: float | None = None
        """`time.monotonic()` of the first snapshot change not yet consumed by the stream."""

    def notify(self, now: float) -> None:
        if self.changed_at is None:
            self.changed_at = now
        self.event.set()

    def consume(self) -> float | None:
        """Clear the event; return when the pending change was made (None if none)."""
        self.event.clear()
        changed_at, self.changed_at = self.changed_at, None
        return changed_at


class SnapshotCache:
    """Snapshots by fleet, plus the streams watching each fleet.

    A fleet with no snapshot of its own is served the default fleet's snapshot. All methods must
    be called from the event loop that runs the ADS server.
    """

    def __init__(
        self,
        *,
        default_fleet: str = "default",
        fleet_of: NodeFleet | None = None,
        node_overrides: Mapping[str, str] | None = None,
    ) -> None:
        self.default_fleet = default_fleet
        self._fleet_of = fleet_of
        self._node_overrides = dict(node_overrides or {})
        self._snapshots: dict[str, Snapshot] = {}
        self._watches: dict[str, set[Watch]] = {}

    def fleet_for(self, node: Any) -> str:
        """The fleet of an Envoy: a node-id override, else `fleet_of(node)`, else `node.cluster`
        (the default fleet when empty)."""
        node_id = str(getattr(node, "id", "") or "")
        if node_id in self._node_overrides:
            return self._node_overrides[node_id]
        if self._fleet_of is not None:
            return self._fleet_of(node) or self.default_fleet
        return str(getattr(node, "cluster", "") or "") or self.default_fleet

    def view_for(self, node: Any) -> str:
        """What an Envoy watches: its fleet, or with a node.locality the view of its place,
        ``fleet@region/zone`` (``compiler.locality.placed_views``; only fleets with
        ``nodeLocality`` have such views, the others resolve to the fleet itself)."""
        fleet = self.fleet_for(node)
        locality = getattr(node, "locality", None)
        region = str(getattr(locality, "region", "") or "")
        if not region:
            return fleet
        zone = str(getattr(locality, "zone", "") or "")
        return f"{fleet}@{region}/{zone}" if zone else f"{fleet}@{region}"

    def resolve(self, view: str) -> str:
        """The snapshot a view is served: the first of ``fleet@region/zone``,
        ``fleet@region``, ``fleet`` that has one, else the default fleet."""
        candidates = [view]
        if "@" in view:
            fleet, place = view.split("@", 1)
            if "/" in place:
                candidates.append(f"{fleet}@{place.split('/', 1)[0]}")
            candidates.append(fleet)
        return next((c for c in candidates if c in self._snapshots), self.default_fleet)

    def served_fleet(self, node: Any) -> str:
        """The fleet (or fleet view) whose config an Envoy gets: its own, or the default
        fleet's when its own has none."""
        return self.resolve(self.view_for(node))

    def snapshot_for(self, fleet: str) -> Snapshot | None:
        """The snapshot a fleet (or view) is served: its own, else the nearest it falls back
        to (``resolve``), else None."""
        return self._snapshots.get(self.resolve(fleet))

    def fleets(self) -> list[str]:
        """Fleets that have a snapshot of their own."""
        return sorted(self._snapshots)

    def set_snapshot(self, fleet: str, snapshot: Snapshot) -> bool:
        """Publish `snapshot` for `fleet` and wake the streams it concerns. Never blocks.
        True when it differs from what the fleet was served (so streams were woken)."""
        previous = self.snapshot_for(fleet)
        self._snapshots[fleet] = snapshot
        if previous == snapshot:
            return False
        self._wake(fleet)
        return True

    def delete_snapshot(self, fleet: str) -> None:
        """Forget a fleet's own snapshot; its Envoys fall back to the default fleet's."""
        if self._snapshots.pop(fleet, None) is not None:
            self._wake(fleet)

    def watch(self, fleet: str) -> Watch:
        """Register a stream for wakeups on changes to what `fleet` is served."""
        watch = Watch(fleet)
        self._watches.setdefault(fleet, set()).add(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        watches = self._watches.get(watch.fleet)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[watch.fleet]

    def watches(self) -> list[Watch]:
        """Every registered watch (the server uses this to end streams at shutdown)."""
        return [w for ws in self._watches.values() for w in ws]

    def _wake(self, fleet: str) -> None:
        now = time.monotonic()
        # Views and fleets without a snapshot of their own follow the one they resolve to.
        targets = [
            w
            for name, ws in self._watches.items()
            if name == fleet or self.resolve(name) == fleet
            for w in ws
        ]
        for watch in targets:
            watch.notify(now)
