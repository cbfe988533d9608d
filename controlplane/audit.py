"""The audit log: who changed what, when, and how, kept in etcd with a retention bound.

Every accepted write through the REST API (and so the CLI) records one entry: the token's
name (never its value), the time, the action, the object, the etcd revision before and after,
and a diff as JSON Patch operations with the old value beside each change. Entries live under
``{prefix}-audit/`` beside kvpilot's watched prefix, so the daemon's mirror of its state never
loads them, keyed by the write's revision so they sort by time. The newest
``retention`` entries are kept; older ones are deleted as new ones arrive.

An entry is written after the change it records (etcd cannot put both in one transaction
through every code path here); if etcd fails in between, the change stands without its entry
and the failure is logged.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from controlplane.etcd import EtcdClient, EtcdError
from controlplane.etcd.keys import decode_json, encode_json
from controlplane.etcd.store import WriteRecord

log = logging.getLogger(__name__)

DEFAULT_RETENTION = 10_000
"""Entries kept when ``--audit-retention`` is not given."""
_PRUNE_SLACK = 0.05
"""Let the log grow this fraction past the bound before pruning, so pruning is occasional."""


def audit_root(prefix: str) -> bytes:
    """The key prefix of the audit log of the installation at ``prefix``."""
    return f"/{prefix.strip('/')}-audit/".encode()


def _pointer(path: list[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def diff(before: Any, after: Any, path: list[str | int] | None = None) -> list[dict[str, Any]]:
    """JSON Patch (RFC 6902) operations that turn ``before`` into ``after``; each ``replace``
    and ``remove`` also carries the old value under ``"old"`` so an entry reads on its own.
    Lists are compared element by element; a list that changed length is replaced whole."""
    path = path or []
    if isinstance(before, dict) and isinstance(after, dict):
        ops: list[dict[str, Any]] = []
        for key in sorted(before.keys() | after.keys()):
            if key not in after:
                ops.append({"op": "remove", "path": _pointer([*path, key]), "old": before[key]})
            elif key not in before:
                ops.append({"op": "add", "path": _pointer([*path, key]), "value": after[key]})
            else:
                ops += diff(before[key], after[key], [*path, key])
        return ops
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [
            op
            for i, (a, b) in enumerate(zip(before, after, strict=True))
            for op in diff(a, b, [*path, i])
        ]
    if before == after and type(before) is type(after):
        return []
    if before is None:
        return [{"op": "add", "path": _pointer(path), "value": after}]
    if after is None:
        return [{"op": "remove", "path": _pointer(path), "old": before}]
    return [{"op": "replace", "path": _pointer(path), "value": after, "old": before}]


class AuditLog:
    """Appends and reads audit entries in etcd."""

    def __init__(
        self, client: EtcdClient, prefix: str, *, retention: int = DEFAULT_RETENTION
    ) -> None:
        if retention < 1:
            raise ValueError("the audit retention must keep at least one entry")
        self.client = client
        self.root = audit_root(prefix)
        self.retention = retention
        self._since_prune = 0

    async def record(self, write: WriteRecord) -> dict[str, Any] | None:
        """Append the entry for a write etcd applied (``Store(on_write=audit.record)``);
        returns it, or None if etcd failed, which is logged: the write itself stands."""
        old = decode_json(write.before) if write.before is not None else None
        obj: dict[str, Any] = {"kind": write.kind, "name": write.name}
        if write.pool is not None:
            obj["pool"] = write.pool
        entry: dict[str, Any] = {
            "at": time.time(),
            "actor": write.actor.name,
            "operation": write.actor.operation,
            "action": write.action,
            "object": obj,
            "revisionBefore": write.before.mod_revision if write.before is not None else None,
            "revisionAfter": write.revision,
            "diff": diff(old, dict(write.after) if write.after is not None else None),
        }
        key = self.root + f"{write.revision:020d}-{secrets.token_hex(3)}".encode()
        entry["id"] = key[len(self.root) :].decode()
        try:
            await self.client.put(key, encode_json(entry))
            self._since_prune += 1
            if self._since_prune >= max(1, int(self.retention * _PRUNE_SLACK)):
                self._since_prune = 0
                await self.prune()
        except EtcdError as error:
            log.error(
                "audit: could not record %s of %s %r by %s at revision %d: %s",
                write.action,
                write.kind,
                write.name,
                write.actor.name,
                write.revision,
                error,
            )
            return None
        return entry

    async def prune(self) -> int:
        """Delete the oldest entries beyond the retention bound; returns how many went."""
        excess = await self.client.count_prefix(self.root) - self.retention
        if excess <= 0:
            return 0
        oldest = await self.client.first_keys(self.root, excess + 1)
        if len(oldest) <= excess:
            return 0
        return await self.client.delete_range(self.root, oldest[excess])

    async def entries_at(self, revision: int) -> list[dict[str, Any]]:
        """The entries of the write that etcd applied at ``revision`` (keys start with it)."""
        kvs, _ = await self.client.get_prefix(self.root + f"{revision:020d}-".encode())
        return [body for kv in kvs if (body := decode_json(kv)) is not None]

    async def entries(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` entries, newest first (values that are not JSON are skipped)."""
        kvs = await self.client.last_values(self.root, limit)
        return [body for kv in kvs if (body := decode_json(kv)) is not None]
