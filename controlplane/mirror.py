"""The daemon's view of etcd: everything under kvpilot's prefix, loaded once and kept current
by a watch, with the keys each change touched.

It keeps every key, even one holding garbage, and leaves decoding to the consumer
(``controlplane.decode``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from controlplane.etcd import (
    CompactedError,
    EtcdClient,
    EtcdClosed,
    EtcdError,
    EventType,
    KeyValue,
    WatchBatch,
)
from controlplane.etcd.keys import DEFAULT_PREFIX, Keys

log = logging.getLogger(__name__)


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
        self._lost_at: float | None = None
        """``time.monotonic()`` when the watch broke, until it is back."""

    @property
    def items(self) -> Mapping[str, KeyValue]:
        """Relative key (``"objects/pools/a"``) -> its current ``KeyValue``. Read-only view."""
        return MappingProxyType(self._items)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def lost(self) -> bool:
        """The watch on etcd broke and is not back: the mirror may lag etcd."""
        return self._lost_at is not None

    @property
    def age(self) -> float:
        """Seconds since the watch broke (0 while it has not): how long the mirror may have
        been missing changes."""
        return 0.0 if self._lost_at is None else time.monotonic() - self._lost_at

    def _lost(self) -> None:
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        self.connected = False

    async def wait_synced(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait for the first full load; ``TimeoutError`` if it does not happen in time."""
        async with asyncio.timeout(timeout):
            await self._synced.wait()

    async def run(self) -> None:
        """Mirror etcd until cancelled or until the client is closed."""
        backoff = self._backoff_initial
        need_list = True
        while True:
            try:
                if need_list:
                    await self._relist()
                    need_list = False
                # Closed on the way out, so a watch left by an error is cancelled at once,
                # not whenever the generator is collected.
                async with contextlib.aclosing(
                    self._client.watch_prefix(self._keys.root, start_revision=self.revision + 1)
                ) as batches:
                    async for batch in batches:
                        if batch.header_revision < self.revision:
                            # etcd has less history than we have seen: restored or replaced.
                            raise _HistoryWentBack(batch.header_revision, self.revision)
                        self.connected = True
                        self._lost_at = None
                        backoff = self._backoff_initial
                        await self._apply(batch)
                raise EtcdError("the watch ended without an error")
            except EtcdClosed:
                # Shutting down: a cancellation that reached a gRPC call in flight can come
                # back as a failed call instead of CancelledError, and retrying would never end.
                log.info("etcd client closed; the mirror stops at revision %d", self.revision)
                return
            except (CompactedError, _HistoryWentBack) as err:
                self._lost()
                self.last_error = str(err)
                log.warning("etcd watch cannot resume at %d: %s; re-listing", self.revision, err)
                need_list = True
            except EtcdError as err:
                self._lost()
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
