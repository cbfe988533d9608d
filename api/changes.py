"""The console's change history (``GET /v1/history``): recent revisions of the policy objects,
newest first, each with a diff against the revision before and who made it.

The revisions are read from etcd's own multi-version store, which keeps every revision until
compaction: it sees writes made by any route (the API, etcdctl, a restore) and needs no second
write path. etcd records no author or wall time, so each revision is joined, by object and
revision, with the audit log's entry for the REST write that made it (``controlplane.audit``):
who (the token's name), when and the operation. A policy's weights written by a rollout step
are named after the rollout (its progress record is written in the same transaction). A
revision with neither was written past the REST API (etcdctl, a restore) or its entry was
pruned; it says so. Deleted objects leave no key to walk back from.
"""

from __future__ import annotations

import asyncio
import difflib
import time
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from controlplane.audit import AuditLog
from controlplane.etcd import CompactedError, KeyValue
from controlplane.etcd.keys import decode_json
from controlplane.etcd.store import Store
from controlplane.rollouts.state import state_key
from policies import KIND_PATHS

HISTORY_DEPTH = 20
"""Revisions read back per object for ``/v1/history``."""

AUDIT_GRACE_S = 10.0
"""How long a revision may go without its audit entry before the answer is final. The entry
is written just after the change it records, so a fresh revision may be read before it."""

_CACHE_SIZE = 20_000
"""Revisions whose predecessor or author is remembered (the oldest go first)."""


def _yaml(body: Mapping[str, Any] | None) -> list[str]:
    if body is None:
        return []
    return yaml.safe_dump(dict(body), sort_keys=False).splitlines(keepends=True)


def unified_diff(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str:
    """A unified diff of two object bodies as YAML (empty when equal)."""
    return "".join(difflib.unified_diff(_yaml(before), _yaml(after), "before", "after", n=2))


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if key not in cache and len(cache) >= _CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = value


class ChangeLog:
    """Recent revisions of the policy objects, read back from etcd's history, with authors.

    A revision's predecessor never changes once written, and neither does its audit entry once
    it exists, so each is read from etcd once and then kept (bounded: the oldest go first).
    """

    def __init__(
        self,
        store: Store,
        audit: AuditLog | None = None,
        *,
        depth: int = HISTORY_DEPTH,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.audit = audit
        self.depth = depth
        self.clock = clock
        self._previous: dict[tuple[bytes, int], KeyValue | None] = {}
        self._authors: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._missing_since: dict[tuple[str, str, int], float] = {}
        """Revisions found without an audit entry, and when that was first seen."""
        self._not_rollouts: dict[tuple[str, str, int], bool] = {}
        """Policy revisions that no rollout wrote."""

    async def _before(self, kv: KeyValue) -> KeyValue | None:
        """The value ``kv`` replaced; None when ``kv`` created the key. ``CompactedError``
        when etcd no longer has it."""
        if kv.version <= 1:
            return None
        cache_key = (kv.key, kv.mod_revision)
        if cache_key in self._previous:
            return self._previous[cache_key]
        previous = await self.store.version_before(kv)
        _remember(self._previous, cache_key, previous)
        return previous

    async def _author(self, kind: str, name: str, revision: int) -> dict[str, Any] | None:
        """Who made the write of ``kind``/``name`` at ``revision``, from the audit log."""
        key = (kind, name, revision)
        if key in self._authors:
            return self._authors[key]
        first_missed = self._missing_since.get(key)
        if first_missed is not None and self.clock() - first_missed > AUDIT_GRACE_S:
            return None
        assert self.audit is not None
        for entry in await self.audit.entries_at(revision):
            written = entry.get("object") or {}
            if written.get("kind") == kind and written.get("name") == name:
                author = {
                    "actor": entry.get("actor"),
                    "operation": entry.get("operation"),
                    "at": entry.get("at"),
                }
                _remember(self._authors, key, author)
                self._missing_since.pop(key, None)
                return author
        if first_missed is None:
            _remember(self._missing_since, key, self.clock())
        return None

    async def _rollout_author(
        self, policy: str, revision: int, rollouts: list[str]
    ) -> dict[str, Any] | None:
        """The rollout whose step wrote RoutingPolicy ``policy`` at ``revision``, if one did.

        A rollout writes its new weights and its progress record in one etcd transaction
        (``controlplane.rollouts``), so the record's revision at ``revision`` says whether
        it was that rollout; its last event then says which step, and by which replica.
        """
        key = ("RoutingPolicy", policy, revision)
        if key in self._authors:
            return self._authors[key]
        if key in self._not_rollouts:
            return None
        for name in rollouts:
            try:
                kv = await self.store.record_at(state_key(name), revision)
            except CompactedError:
                return None
            if kv is None or kv.mod_revision != revision:
                continue
            history = (decode_json(kv) or {}).get("history") or [{}]
            event = history[-1] if isinstance(history[-1], dict) else {}
            what = event.get("event")
            if what == "step" and isinstance(event.get("step"), int):
                what = f"step {event['step'] + 1}"
            author = {
                "actor": f"rollout/{name}",
                "operation": f"rollout {what}" if what else "rollout",
                "at": event.get("at"),
                "replica": event.get("by"),
            }
            _remember(self._authors, key, author)
            return author
        # The transaction is atomic: a rollout that did not write its record then did not
        # write the policy either, now or later.
        _remember(self._not_rollouts, key, True)
        return None

    async def _who(
        self, kind: str, name: str, revision: int, rollouts: Mapping[str, list[str]]
    ) -> dict[str, Any] | None:
        """The audit log's author of a revision, else (for a policy) the rollout that wrote it."""
        author = await self._author(kind, name, revision)
        if author is None and kind == "RoutingPolicy" and rollouts.get(name):
            author = await self._rollout_author(name, revision, rollouts[name])
        return author

    async def changes(self, limit: int) -> dict[str, Any]:
        """The newest ``limit`` object revisions, each with its diff and author, newest first."""
        kinds = {path: kind for kind, path in KIND_PATHS.items()}
        kvs, revision = await self.store.object_heads()
        entries: list[dict[str, Any]] = []
        # Policy name -> the rollouts that target it (and may have written its weights).
        rollouts: dict[str, list[str]] = {}
        truncated = False
        for current in kvs:
            parts = self.store.keys.relative(current.key).split("/")
            if len(parts) != 3:
                continue
            kind, name = kinds.get(parts[1], parts[1]), parts[2]
            if kind == "Rollout":
                spec = (decode_json(current) or {}).get("spec")
                target = spec.get("target") if isinstance(spec, dict) else None
                if isinstance(target, dict) and isinstance(target.get("policy"), str):
                    rollouts.setdefault(target["policy"], []).append(name)
            kv: KeyValue | None = current
            for _ in range(self.depth):
                if kv is None:
                    break
                try:
                    before = await self._before(kv)
                except CompactedError:
                    truncated = True
                    before = None
                    compacted = True
                else:
                    compacted = False
                body, previous = decode_json(kv), decode_json(before) if before else None
                entries.append(
                    {
                        "revision": kv.mod_revision,
                        "kind": kind,
                        "name": name,
                        "change": "created"
                        if kv.version <= 1
                        else "updated (earlier history compacted)"
                        if compacted
                        else "updated",
                        "version": kv.version,
                        "diff": unified_diff(previous, body),
                    }
                )
                kv = before
        entries.sort(key=lambda entry: entry["revision"], reverse=True)
        shown = entries[:limit]
        if self.audit is not None:
            authors = await asyncio.gather(
                *(self._who(e["kind"], e["name"], e["revision"], rollouts) for e in shown)
            )
            for entry, author in zip(shown, authors, strict=True):
                entry["author"] = author
        return {
            "revision": revision,
            "items": shown,
            "compacted": truncated,
            "source": "etcd revision history",
            "authors": "audit log" if self.audit is not None else None,
        }
