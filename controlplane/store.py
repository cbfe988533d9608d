"""kvpilot's data in etcd: the key layout, an object store for the REST API, and the daemon's
watched mirror of everything under the prefix.

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
``{prefix}-audit/{revision}-{random}``         one audit entry (``controlplane.audit``);
                                               beside the prefix, not under it, so the
                                               daemon's mirror never loads the log
=============================================  =============================================

Names (object names, pools, endpoint ids, replica and node ids) are single key segments: no
``/``, not empty. An object's etcd ``mod_revision`` is its revision, used as the REST ETag:
writes that carry an expected revision fail with ``RevisionMismatch`` if someone else wrote
first.

The store does not validate object bodies; the ``policies`` package does, and the daemon
skips (and reports) what does not validate. ``StateMirror`` therefore keeps every key, even one
holding garbage, and leaves decoding to the consumer (``decode_json``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from controlplane.etcd import (
    CompactedError,
    ConflictError,
    EtcdClient,
    EtcdError,
    EventType,
    KeyValue,
    WatchBatch,
)
from policies import KIND_PATHS

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/kvpilot"

KIND_PATH: Mapping[str, str] = MappingProxyType(KIND_PATHS)
"""Object kind -> its key segment under ``objects/`` (``policies.KIND_PATHS``)."""

OBJECTS = "objects"
ENDPOINTS = "endpoints"
TELEMETRY = "telemetry"
STATUS = "status"


class StoreError(EtcdError):
    """A store operation failed in a way the caller can fix."""


class NotFound(StoreError):
    """The object does not exist."""


class AlreadyExists(ConflictError):
    """A create found the object already there."""

    def __init__(self, kind: str, name: str, key: bytes, actual_mod_revision: int) -> None:
        self.kind = kind
        self.name = name
        super().__init__(key, actual_mod_revision, 0)
        self.args = (
            f"{kind} {name!r} already exists (revision {actual_mod_revision}); "
            "replace it, or delete it first",
        )


class RevisionMismatch(ConflictError):
    """A write carried an expected revision, and the object has moved on."""

    def __init__(
        self, kind: str, name: str, key: bytes, actual_mod_revision: int, expected: int
    ) -> None:
        self.kind = kind
        self.name = name
        super().__init__(key, actual_mod_revision, expected)
        self.args = (
            f"{kind} {name!r} was changed by someone else: you have revision {expected}, "
            f"it is now at revision {actual_mod_revision}; fetch it again, re-apply your "
            "change and retry",
        )


class InvalidName(StoreError, ValueError):
    """A name cannot be used as a key segment."""


class UnknownKind(StoreError, ValueError):
    """The kind has no key path."""


class InvalidValue(StoreError):
    """A stored value is not a JSON object (written by something other than kvpilot)."""


@dataclass(frozen=True, slots=True)
class Actor:
    """Who asks for a write: the API token's name (never its value) and the REST operation."""

    name: str
    operation: str = ""


@dataclass(frozen=True, slots=True)
class WriteRecord:
    """One write etcd applied on an actor's behalf, with the value it replaced."""

    actor: Actor
    action: str
    """``create``, ``replace``, ``delete``, ``register`` or ``deregister``."""
    kind: str
    """The object kind, or ``Endpoint`` for a registration."""
    name: str
    pool: str | None
    before: KeyValue | None
    after: Mapping[str, Any] | None
    revision: int


OnWrite = Callable[[WriteRecord], Awaitable[Any]]


@dataclass(frozen=True)
class StoredObject:
    kind: str
    name: str
    body: dict[str, Any]
    revision: int
    """etcd ``mod_revision``: the ETag. Pass it back as ``expect_revision`` to update safely."""
    created_revision: int


def decode_json(kv: KeyValue | bytes) -> dict[str, Any] | None:
    """The value as a JSON object, or ``None`` if it is not one."""
    raw = kv if isinstance(kv, bytes) else kv.value
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def encode_json(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


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

    def __init__(self, prefix: str = DEFAULT_PREFIX, kinds: Mapping[str, str] = KIND_PATH) -> None:
        self.prefix = _normalize_prefix(prefix)
        self.kinds = dict(kinds)
        self._kind_by_path = {path: kind for kind, path in self.kinds.items()}

    @property
    def root(self) -> bytes:
        """The watched prefix, with its trailing slash."""
        return (self.prefix + "/").encode()

    def kind_path(self, kind: str) -> str:
        """``"Pool"`` or ``"pools"`` -> ``"pools"``."""
        if kind in self.kinds:
            return self.kinds[kind]
        if kind in self._kind_by_path:
            return kind
        known = ", ".join(sorted(self.kinds))
        raise UnknownKind(f"unknown kind {kind!r}; known kinds: {known}")

    def kind_name(self, kind: str) -> str:
        """``"pools"`` or ``"Pool"`` -> ``"Pool"``."""
        return self._kind_by_path[self.kind_path(kind)]

    def absolute(self, relative: str) -> bytes:
        return f"{self.prefix}/{relative}".encode()

    def relative(self, key: bytes) -> str:
        return key[len(self.root) :].decode(errors="backslashreplace")

    def object(self, kind: str, name: str) -> str:
        return f"{OBJECTS}/{self.kind_path(kind)}/{_segment(name, 'name')}"

    def objects(self, kind: str) -> str:
        return f"{OBJECTS}/{self.kind_path(kind)}/"

    def endpoint(self, pool: str, endpoint_id: str) -> str:
        return f"{ENDPOINTS}/{_segment(pool, 'pool')}/{_segment(endpoint_id, 'endpoint id')}"

    def telemetry(self, pool: str, endpoint_id: str) -> str:
        return f"{TELEMETRY}/{_segment(pool, 'pool')}/{_segment(endpoint_id, 'endpoint id')}"

    def envoy_status(self, replica_id: str, node_id: str) -> str:
        return (
            f"{STATUS}/envoys/{_segment(replica_id, 'replica id')}/{_segment(node_id, 'node id')}"
        )


class Store:
    """CRUD over kvpilot's keys, with revisions for optimistic concurrency."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str = DEFAULT_PREFIX,
        *,
        kinds: Mapping[str, str] = KIND_PATH,
        on_write: OnWrite | None = None,
    ) -> None:
        self.client = client
        self.keys = Keys(prefix, kinds)
        self.on_write = on_write
        """Called after each write made with an ``actor`` (the audit log)."""

    async def _written(
        self,
        actor: Actor | None,
        action: str,
        kind: str,
        name: str,
        before: KeyValue | None,
        after: Mapping[str, Any] | None,
        revision: int,
        pool: str | None = None,
    ) -> None:
        if actor is not None and self.on_write is not None:
            await self.on_write(
                WriteRecord(actor, action, kind, name, pool, before, after, revision)
            )

    # -- declarative objects -----------------------------------------------------------------

    async def create(
        self, kind: str, name: str, body: Mapping[str, Any], *, actor: Actor | None = None
    ) -> StoredObject:
        """Create an object; ``AlreadyExists`` if one with that name exists."""
        kind = self.keys.kind_name(kind)
        key = self.keys.absolute(self.keys.object(kind, name))
        try:
            revision = await self.client.put(key, encode_json(body), expect_mod_revision=0)
        except ConflictError as err:
            raise AlreadyExists(kind, name, key, err.actual_mod_revision) from None
        await self._written(actor, "create", kind, name, None, body, revision)
        return StoredObject(kind, name, dict(body), revision, revision)

    async def replace(
        self,
        kind: str,
        name: str,
        body: Mapping[str, Any],
        *,
        expect_revision: int | None,
        actor: Actor | None = None,
    ) -> StoredObject:
        """Write an object. ``expect_revision=None`` creates or overwrites unconditionally;
        ``N`` writes only if the object is at revision ``N`` (``RevisionMismatch`` otherwise,
        ``NotFound`` if it was deleted); ``0`` means it must not exist yet."""
        kind = self.keys.kind_name(kind)
        key = self.keys.absolute(self.keys.object(kind, name))
        try:
            kv, before = await self.client.put_with_previous(
                key, encode_json(body), expect_mod_revision=expect_revision
            )
        except ConflictError as err:
            raise self._conflict(kind, name, err) from None
        action = "replace" if before is not None else "create"
        await self._written(actor, action, kind, name, before, body, kv.mod_revision)
        return StoredObject(kind, name, dict(body), kv.mod_revision, kv.create_revision)

    async def get(self, kind: str, name: str) -> StoredObject | None:
        """The object, or ``None``. ``InvalidValue`` if its key holds something not JSON."""
        kind = self.keys.kind_name(kind)
        kv = await self.client.get(self.keys.absolute(self.keys.object(kind, name)))
        if kv is None:
            return None
        return self._decode(kind, name, kv)

    async def list(self, kind: str) -> tuple[list[StoredObject], int]:
        """All objects of a kind, sorted by name, and the revision of that snapshot.

        Values that are not JSON objects are logged and left out.
        """
        kind = self.keys.kind_name(kind)
        kvs, revision = await self.client.get_prefix(self.keys.absolute(self.keys.objects(kind)))
        objects: list[StoredObject] = []
        for kv in kvs:
            name = self.keys.relative(kv.key).rsplit("/", 1)[-1]
            try:
                objects.append(self._decode(kind, name, kv))
            except InvalidValue as err:
                log.warning("%s", err)
        return objects, revision

    async def delete(
        self,
        kind: str,
        name: str,
        *,
        expect_revision: int | None = None,
        actor: Actor | None = None,
    ) -> bool:
        """Delete an object; False if it did not exist. With ``expect_revision``:
        ``RevisionMismatch`` if it moved on, ``NotFound`` if it is already gone."""
        kind = self.keys.kind_name(kind)
        key = self.keys.absolute(self.keys.object(kind, name))
        try:
            before, revision = await self.client.delete_with_previous(
                key, expect_mod_revision=expect_revision
            )
        except ConflictError as err:
            raise self._conflict(kind, name, err) from None
        if before is None:
            return False
        await self._written(actor, "delete", kind, name, before, None, revision)
        return True

    def _conflict(self, kind: str, name: str, err: ConflictError) -> StoreError | ConflictError:
        expected = err.expected_mod_revision
        if expected == 0:
            return AlreadyExists(kind, name, err.key, err.actual_mod_revision)
        if err.actual_mod_revision == 0:
            return NotFound(
                f"{kind} {name!r} does not exist (it was deleted after revision {expected}); "
                "create it again if you still want it"
            )
        return RevisionMismatch(kind, name, err.key, err.actual_mod_revision, expected or 0)

    def _decode(self, kind: str, name: str, kv: KeyValue) -> StoredObject:
        body = decode_json(kv)
        if body is None:
            raise InvalidValue(
                f"{kind} {name!r} at {kv.key.decode(errors='backslashreplace')} is not a JSON "
                "object (written by another tool?); replace or delete it"
            )
        return StoredObject(kind, name, body, kv.mod_revision, kv.create_revision)

    # -- endpoints, telemetry, status ----------------------------------------------------------

    async def _put_leased(
        self, relative: str, body: Mapping[str, Any], ttl: int | None, lease: int | None
    ) -> tuple[KeyValue, KeyValue | None, int | None]:
        if ttl is not None and lease is not None:
            raise ValueError("give either ttl (grant a new lease) or lease (reuse one), not both")
        if ttl is not None:
            lease = await self.client.grant_lease(ttl)
        kv, before = await self.client.put_with_previous(
            self.keys.absolute(relative), encode_json(body), lease=lease or 0
        )
        return kv, before, lease

    async def put_endpoint(
        self,
        pool: str,
        endpoint_id: str,
        body: Mapping[str, Any],
        *,
        ttl: int | None = None,
        lease: int | None = None,
        actor: Actor | None = None,
    ) -> tuple[int, int | None]:
        """Register an endpoint; returns (revision, lease id or None).

        ``ttl`` grants a new lease so the registration disappears unless it is kept alive;
        ``lease`` attaches to an existing one (an agent registering several endpoints).
        """
        kv, before, lease = await self._put_leased(
            self.keys.endpoint(pool, endpoint_id), body, ttl, lease
        )
        await self._written(
            actor, "register", "Endpoint", endpoint_id, before, body, kv.mod_revision, pool
        )
        return kv.mod_revision, lease

    async def delete_endpoint(
        self, pool: str, endpoint_id: str, *, actor: Actor | None = None
    ) -> bool:
        before, revision = await self.client.delete_with_previous(
            self.keys.absolute(self.keys.endpoint(pool, endpoint_id))
        )
        if before is None:
            return False
        await self._written(
            actor, "deregister", "Endpoint", endpoint_id, before, None, revision, pool
        )
        return True

    async def put_telemetry(
        self,
        pool: str,
        endpoint_id: str,
        body: Mapping[str, Any],
        *,
        lease: int | None = None,
        ttl: int | None = None,
    ) -> tuple[int, int | None]:
        """Record an endpoint's telemetry, normally under the reporting agent's ``lease``, so
        a silent agent's numbers expire instead of steering traffic forever."""
        kv, _, lease = await self._put_leased(
            self.keys.telemetry(pool, endpoint_id), body, ttl, lease
        )
        return kv.mod_revision, lease

    async def delete_telemetry(self, pool: str, endpoint_id: str) -> bool:
        return await self.client.delete(self.keys.absolute(self.keys.telemetry(pool, endpoint_id)))

    async def put_envoy_status(
        self, replica_id: str, node_id: str, body: Mapping[str, Any], *, lease: int
    ) -> int:
        """Record an Envoy's connection status under the control-plane replica's lease."""
        kv, _, _ = await self._put_leased(
            self.keys.envoy_status(replica_id, node_id), body, None, lease
        )
        return kv.mod_revision

    async def delete_envoy_status(self, replica_id: str, node_id: str) -> bool:
        return await self.client.delete(
            self.keys.absolute(self.keys.envoy_status(replica_id, node_id))
        )


@dataclass(frozen=True)
class StateChange:
    """What one applied watch batch (or re-list) changed."""

    revision: int
    """The mirror's revision after the change."""
    changed: frozenset[str]
    """Relative keys (``"endpoints/p/e1"``) that were put or deleted."""
    full_resync: bool
    """True after a (re-)list: the whole state was replaced, rebuild everything."""

    @property
    def sections(self) -> frozenset[str]:
        """The top-level sections touched (``objects``, ``endpoints``, ...): when only
        ``endpoints`` and ``telemetry`` changed, the consumer can take the EDS-only fast path."""
        return frozenset(key.split("/", 1)[0] for key in self.changed)


OnChange = Callable[[StateChange], Awaitable[None] | None]


class StateMirror:
    """The daemon's view of etcd, kept current by a watch.

    Loads everything under the prefix, then follows the watch. On disconnect it keeps the last
    state, reconnects with capped, jittered exponential backoff and resumes from the last
    revision + 1; if that revision was compacted (or etcd's history went backwards, as after a
    restore), it re-lists and replaces the state wholesale. ``on_change`` runs after every
    batch that changed something, with the changed keys and the revision.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str = DEFAULT_PREFIX,
        on_change: OnChange | None = None,
        *,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
    ) -> None:
        self._client = client
        self._keys = Keys(prefix)
        self._on_change = on_change
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._items: dict[str, KeyValue] = {}
        self._synced = asyncio.Event()
        self.revision = 0
        """Every change up to this revision is reflected in ``items``."""
        self.connected = False
        """True while the watch is established."""
        self.last_error: str | None = None
        """Why the mirror last lost etcd (kept after recovery, for status pages)."""
        self.resyncs = 0
        """How many full (re-)lists have been applied, the initial load included."""

    @property
    def items(self) -> Mapping[str, KeyValue]:
        """Relative key (``"objects/pools/a"``) -> its current ``KeyValue``. Read-only view."""
        return MappingProxyType(self._items)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    async def wait_synced(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait for the first full load; ``TimeoutError`` if it does not happen in time."""
        await asyncio.wait_for(self._synced.wait(), timeout)

    async def run(self) -> None:
        """Mirror etcd until cancelled."""
        backoff = self._backoff_initial
        need_list = True
        while True:
            try:
                if need_list:
                    await self._relist()
                    need_list = False
                async for batch in self._client.watch_prefix(
                    self._keys.root, start_revision=self.revision + 1
                ):
                    if batch.header_revision < self.revision:
                        # etcd has less history than we have seen: restored or replaced.
                        raise _HistoryWentBack(batch.header_revision, self.revision)
                    self.connected = True
                    backoff = self._backoff_initial
                    await self._apply(batch)
                raise EtcdError("the watch ended without an error")
            except (CompactedError, _HistoryWentBack) as err:
                self.connected = False
                self.last_error = str(err)
                log.warning("etcd watch cannot resume at %d: %s; re-listing", self.revision, err)
                need_list = True
            except EtcdError as err:
                self.connected = False
                self.last_error = str(err)
                delay = backoff * random.uniform(0.5, 1.5)
                log.warning(
                    "etcd: %s; retrying in %.1fs (serving revision %d)", err, delay, self.revision
                )
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, self._backoff_max)

    async def _relist(self) -> None:
        kvs, revision = await self._client.get_prefix(self._keys.root)
        fresh = {self._keys.relative(kv.key): kv for kv in kvs}
        old = self._items
        changed = frozenset(
            key
            for key in old.keys() | fresh.keys()
            if (a := old.get(key)) is None
            or (b := fresh.get(key)) is None
            or a.mod_revision != b.mod_revision
        )
        self._items = fresh
        self.revision = revision
        self.resyncs += 1
        self._synced.set()
        log.info("loaded %d keys under %s at revision %d", len(fresh), self._keys.prefix, revision)
        await self._notify(StateChange(revision, changed, full_resync=True))

    async def _apply(self, batch: WatchBatch) -> None:
        if not batch:  # watch established, or a progress notification
            self.revision = max(self.revision, batch.revision)
            return
        changed: set[str] = set()
        for event in batch:
            key = self._keys.relative(event.kv.key)
            if event.type is EventType.DELETE:
                self._items.pop(key, None)
            else:
                self._items[key] = event.kv
            changed.add(key)
        self.revision = max(self.revision, batch.revision)
        await self._notify(StateChange(self.revision, frozenset(changed), full_resync=False))

    async def _notify(self, change: StateChange) -> None:
        if self._on_change is None:
            return
        try:
            result = self._on_change(change)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            # The state is applied either way; one failing consumer must not stop the mirror.
            log.exception("on_change failed at revision %d", change.revision)


class _HistoryWentBack(EtcdError):
    def __init__(self, etcd_revision: int, seen: int) -> None:
        super().__init__(
            f"etcd is at revision {etcd_revision} but revision {seen} was already seen "
            "(was etcd restored from a backup or replaced?)"
        )
