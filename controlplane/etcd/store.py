"""The store every etcd access goes through: declarative objects, endpoint registrations,
telemetry and status records, over the keys of ``controlplane.etcd.keys`` (the daemon's watched
mirror of them is ``controlplane.mirror``).

An object's etcd ``mod_revision`` is its revision, used as the REST ETag: writes that carry an
expected revision fail with ``RevisionMismatch`` if someone else wrote first.

The store does not validate object bodies; the ``policies`` package does, and the daemon
skips (and reports) what does not validate (``controlplane.decode``).
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.etcd import (
    ConflictError,
    EtcdClient,
    EtcdStatus,
    KeyValue,
    LeaseKeeper,
)
from controlplane.etcd.keys import (
    DEFAULT_PREFIX,
    OBJECTS,
    Keys,
    StoreError,
    decode_json,
    encode_json,
)

log = logging.getLogger(__name__)


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


class InvalidValue(StoreError):
    """A stored value is not a JSON object (written by something other than kvpilot)."""


class Contended(StoreError):
    """A read-modify-write lost the race to other writers on every attempt."""


@dataclass(frozen=True)
class Registration:
    """A registered endpoint as stored."""

    endpoint_id: str
    body: dict[str, Any] | None
    """The registration, or None when its value is not a JSON object."""
    revision: int
    lease: int
    """Its lease id; 0 for a registration without a TTL."""


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
    """``create``, ``replace``, ``update`` (a status record), ``delete``, ``register`` or
    ``deregister``."""
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


class Store:
    """CRUD over kvpilot's keys, with revisions for optimistic concurrency."""

    def __init__(
        self, client: EtcdClient, prefix: str = DEFAULT_PREFIX, *, on_write: OnWrite | None = None
    ) -> None:
        self.client = client
        self.keys = Keys(prefix)
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

    def get_from(self, items: Mapping[str, KeyValue], kind: str, name: str) -> StoredObject | None:
        """`get`, answered from a `StateMirror`'s items instead of etcd."""
        kind = self.keys.kind_name(kind)
        kv = items.get(self.keys.object(kind, name))
        return None if kv is None else self._decode(kind, name, kv)

    def list_from(self, items: Mapping[str, KeyValue], kind: str) -> list[StoredObject]:
        """`list`'s objects, answered from a `StateMirror`'s items instead of etcd."""
        kind = self.keys.kind_name(kind)
        prefix = self.keys.objects(kind)
        return self._decode_all(
            kind, [kv for key, kv in sorted(items.items()) if key.startswith(prefix)]
        )

    async def list(self, kind: str) -> tuple[list[StoredObject], int]:
        """All objects of a kind, sorted by name, and the revision of that snapshot.

        Values that are not JSON objects are logged and left out.
        """
        kind = self.keys.kind_name(kind)
        kvs, revision = await self.client.get_prefix(self.keys.absolute(self.keys.objects(kind)))
        return self._decode_all(kind, kvs), revision

    def _decode_all(self, kind: str, kvs: Iterable[KeyValue]) -> builtins.list[StoredObject]:
        objects: builtins.list[StoredObject] = []
        for kv in kvs:
            name = self.keys.relative(kv.key).rsplit("/", 1)[-1]
            try:
                objects.append(self._decode(kind, name, kv))
            except InvalidValue as err:
                log.warning("%s", err)
        return objects

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

    async def update(
        self,
        kind: str,
        name: str,
        edit: Callable[[StoredObject | None], Mapping[str, Any]],
        *,
        attempts: int = 10,
        actor: Actor | None = None,
    ) -> StoredObject:
        """Read-modify-write with compare-and-swap: `edit` gets the object as it is now (None
        when it does not exist; it raises to give up) and returns the new body, which is
        written only if nobody wrote in between; otherwise read and edit again, up to
        `attempts` times, then ``Contended``."""
        kind = self.keys.kind_name(kind)
        for _attempt in range(attempts):
            current = await self.get(kind, name)
            body = edit(current)
            expected = current.revision if current is not None else 0
            try:
                return await self.replace(kind, name, body, expect_revision=expected, actor=actor)
            except (RevisionMismatch, NotFound, AlreadyExists):
                continue
        raise Contended(f"{kind} {name!r} kept changing under {attempts} attempts; retry")

    async def object_heads(self) -> tuple[Sequence[KeyValue], int]:
        """Every object's current key and value (for walking its history back with
        `version_before`), and the revision they were read at."""
        return await self.client.get_prefix(self.keys.absolute(f"{OBJECTS}/"))

    async def version_before(self, kv: KeyValue) -> KeyValue | None:
        """What the key held before `kv` was written: None when `kv` created it (etcd keeps
        every revision until compaction); ``CompactedError`` when etcd no longer has it."""
        if kv.version <= 1:
            return None
        return await self.client.get(kv.key, revision=kv.mod_revision - 1)

    @property
    def etcd_endpoints(self) -> Sequence[str]:
        """The etcd endpoints this store talks to."""
        return self.client.endpoints

    async def values(self, sections: Sequence[str]) -> dict[str, bytes]:
        """Relative key -> value of every key under `sections` (``objects``, ``endpoints``,
        ...), for a consumer that decodes them (``controlplane.decode``)."""
        found: dict[str, bytes] = {}
        for section in sections:
            kvs, _ = await self.client.get_prefix(self.keys.absolute(f"{section}/"))
            found.update((self.keys.relative(kv.key), kv.value) for kv in kvs)
        return found

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
                f"{kind} {name!r}: the value at etcd key {kv.key.decode(errors='backslashreplace')} "
                "is not a JSON object kvpilot can read (written by another tool?); replace it "
                "with PUT or remove it with DELETE"
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

    async def endpoints(self, pool: str) -> tuple[Sequence[Registration], int]:
        """The endpoints registered to `pool`, by id, and the revision of that read."""
        kvs, revision = await self.client.get_prefix(self.keys.absolute(self.keys.endpoints(pool)))
        return [self._registration(kv) for kv in kvs], revision

    async def get_endpoint(self, pool: str, endpoint_id: str) -> Registration | None:
        """One registered endpoint, or None."""
        kv = await self.client.get(self.keys.absolute(self.keys.endpoint(pool, endpoint_id)))
        return self._registration(kv) if kv is not None else None

    def endpoints_from(
        self, items: Mapping[str, KeyValue], pool: str
    ) -> builtins.list[Registration]:
        """`endpoints`, answered from a `StateMirror`'s items instead of etcd."""
        prefix = self.keys.endpoints(pool)
        return [
            self._registration(kv) for key, kv in sorted(items.items()) if key.startswith(prefix)
        ]

    def _registration(self, kv: KeyValue) -> Registration:
        endpoint_id = self.keys.relative(kv.key).rsplit("/", 1)[-1]
        return Registration(endpoint_id, decode_json(kv), kv.mod_revision, kv.lease)

    async def lease_ttl(self, lease: int) -> int | None:
        """Seconds left on a lease; None for no lease (0)."""
        if not lease:
            return None
        return await self.client.lease_time_to_live(lease)

    def keep_lease(
        self, ttl: int, *, on_regrant: Callable[[int], Awaitable[None] | None] | None = None
    ) -> LeaseKeeper:
        """A lease kept alive while the returned context manager is entered (an agent's
        registrations and telemetry, a replica's Envoy status records live under one); see
        ``EtcdClient.keepalive_forever``."""
        return self.client.keepalive_forever(ttl, on_regrant=on_regrant)

    async def status(self) -> EtcdStatus:
        """The etcd member's status: an answer means etcd is reachable."""
        return await self.client.status()

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
        self, pool: str, endpoint_id: str, body: Mapping[str, Any], *, lease: int | None = None
    ) -> int:
        """Record an endpoint's telemetry, normally under the reporting agent's ``lease``, so
        a silent agent's numbers expire instead of steering traffic forever."""
        kv, _, _ = await self._put_leased(self.keys.telemetry(pool, endpoint_id), body, None, lease)
        return kv.mod_revision

    async def put_telemetry_many(
        self, records: Sequence[tuple[str, str, Mapping[str, Any]]], *, lease: int
    ) -> int:
        """Record several endpoints' telemetry ((pool, endpoint id, body) each) under one
        ``lease``, batched into few etcd transactions; returns the last revision."""
        return await self.client.put_many(
            [
                (self.keys.absolute(self.keys.telemetry(pool, endpoint_id)), encode_json(body))
                for pool, endpoint_id, body in records
            ],
            lease=lease,
        )

    async def delete_telemetry(self, pool: str, endpoint_id: str) -> bool:
        return await self.client.delete(self.keys.absolute(self.keys.telemetry(pool, endpoint_id)))

    async def put_envoy_statuses(
        self, replica_id: str, records: Sequence[tuple[str, Mapping[str, Any]]], *, lease: int
    ) -> int:
        """Record Envoys' connection status ((node key, body) each) under the control-plane
        replica's lease, in as few transactions as fit; returns the last revision."""
        return await self.client.put_many(
            [
                (self.keys.absolute(self.keys.envoy_status(replica_id, node)), encode_json(body))
                for node, body in records
            ],
            lease=lease,
        )

    # -- status records read and written by key (rollout progress and commands) ------------

    async def get_record(self, relative: str) -> dict[str, Any] | None:
        """The JSON record at ``relative`` (a key under the prefix), or None."""
        kv = await self.client.get(self.keys.absolute(relative))
        return decode_json(kv) if kv is not None else None

    async def record_at(self, relative: str, revision: int) -> KeyValue | None:
        """The key at ``relative`` as it was at ``revision`` (its ``mod_revision`` tells
        whether that revision wrote it); ``CompactedError`` when etcd no longer has it."""
        return await self.client.get(self.keys.absolute(relative), revision=revision)

    async def put_record(
        self,
        relative: str,
        body: Mapping[str, Any],
        *,
        kind: str,
        name: str,
        actor: Actor | None = None,
    ) -> int:
        """Write the JSON record at ``relative``; with an ``actor`` the write is audited as
        an ``update`` of ``kind``/``name`` (a rollout command, for example)."""
        kv, before = await self.client.put_with_previous(
            self.keys.absolute(relative), encode_json(body), expect_mod_revision=None
        )
        await self._written(actor, "update", kind, name, before, body, kv.mod_revision)
        return kv.mod_revision

    async def delete_envoy_status(self, replica_id: str, node_id: str) -> bool:
        return await self.client.delete(
            self.keys.absolute(self.keys.envoy_status(replica_id, node_id))
        )
