"""From etcd state to Envoy snapshots: decode, compile, translate, publish.

The reconciler is told which keys changed (by ``StateMirror``) and rebuilds after a quiet
period, never waiting longer than a maximum from the first change (debounce). Changes that touch
only registered endpoints or telemetry take the fast path: policies, clusters, listeners and
routes are reused and only the ClusterLoadAssignments are translated again.

A value in etcd that is not a valid object (written with etcdctl, or by an older kvpilot) is
skipped with a logged error visible in status; the last valid version of that object keeps
serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controlplane.etcd import KeyValue
from controlplane.store import KIND_PATH, StateChange
from policies import (
    DEFAULT_FLEET,
    Endpoint,
    Fleet,
    PolicyError,
    PolicyObject,
    PolicyState,
    Pool,
    RoutingPlan,
    RoutingPolicy,
    compile_plan,
    parse_object,
)
from xdsserver import resources
from xdsserver.snapshot import Snapshot, SnapshotCache
from xdsserver.translate import translate, translate_endpoints

log = logging.getLogger(__name__)

PATH_KIND = {path: kind for kind, path in KIND_PATH.items()}
FAST_PATH_PREFIXES = ("endpoints/", "telemetry/")
STATUS_PREFIX = "status/"


@dataclass(frozen=True, slots=True)
class ObjectError:
    """A value in etcd that could not be used."""

    key: str
    message: str
    revision: int
    serving_previous: bool


@dataclass(slots=True)
class BuildInfo:
    """What the last rebuild did, for status and logs."""

    revision: int = 0
    at: float = 0.0
    seconds: float = 0.0
    fast_path: bool = False
    fleets: dict[str, dict[str, str]] = field(default_factory=dict)


class ReconcileMetrics:
    """Prometheus metrics of the reconcile loop."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kwargs: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.builds = Counter(
            "kvpilot_reconcile_builds",
            "Snapshot rebuilds, by path (full or fast).",
            ["path"],
            **kwargs,
        )
        self.build_seconds = Histogram(
            "kvpilot_reconcile_build_seconds",
            "Time to decode, compile, translate and publish one rebuild.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            **kwargs,
        )
        self.invalid_objects = Gauge(
            "kvpilot_invalid_objects", "Values in etcd that failed validation.", **kwargs
        )
        self.diagnostics = Gauge(
            "kvpilot_plan_diagnostics",
            "Problems found while compiling, by severity.",
            ["severity"],
            **kwargs,
        )


class Reconciler:
    """Keeps the snapshot cache in line with the state in etcd."""

    def __init__(
        self,
        cache: SnapshotCache,
        *,
        quiet_period: float = 0.02,
        max_wait: float = 0.25,
        metrics: ReconcileMetrics | None = None,
    ) -> None:
        self.cache = cache
        self.quiet_period = quiet_period
        self.max_wait = max_wait
        self.metrics = metrics or ReconcileMetrics(CollectorRegistry())
        self.errors: dict[str, ObjectError] = {}
        self.plan: RoutingPlan | None = None
        self.last_build = BuildInfo()
        self._objects: dict[str, PolicyObject] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._items: Mapping[str, KeyValue] = {}
        self._pending: set[str] = set()
        self._pending_full = False
        self._pending_revision = 0
        self._dirty = asyncio.Event()
        self._first_change = 0.0
        self._last_change = 0.0
        self._built = asyncio.Event()

    # -- input ---------------------------------------------------------------------------------

    def on_change(self, change: StateChange, items: Mapping[str, KeyValue]) -> None:
        """Record a change; the run loop rebuilds after the debounce."""
        self._items = items
        if not change.full_resync and all(key.startswith(STATUS_PREFIX) for key in change.changed):
            return  # Envoy status records of kvpilot replicas: nothing to rebuild
        now = time.monotonic()
        if not self._dirty.is_set():
            self._first_change = now
        self._last_change = now
        self._pending.update(change.changed)
        self._pending_full = self._pending_full or change.full_resync
        self._pending_revision = max(self._pending_revision, change.revision)
        self._dirty.set()

    @property
    def ready(self) -> bool:
        """True once a snapshot has been published."""
        return self._built.is_set()

    # -- loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Debounce changes and rebuild, until cancelled."""
        while True:
            await self._dirty.wait()
            while True:
                now = time.monotonic()
                deadline = min(
                    self._last_change + self.quiet_period, self._first_change + self.max_wait
                )
                if now >= deadline:
                    break
                await asyncio.sleep(deadline - now)
            self._dirty.clear()
            changed, self._pending = self._pending, set()
            full, self._pending_full = self._pending_full, False
            try:
                self.rebuild(
                    self._items, changed=changed, full_resync=full, revision=self._pending_revision
                )
            except Exception:
                # A bug in compile or translate must not stop the daemon: keep serving the last
                # snapshot and try again on the next change.
                log.exception("rebuild failed; the previous snapshot keeps serving")

    # -- build ---------------------------------------------------------------------------------

    def rebuild(
        self,
        items: Mapping[str, KeyValue],
        *,
        changed: set[str] | None = None,
        full_resync: bool = True,
        revision: int = 0,
    ) -> None:
        """Decode the changed keys, compile, translate and publish. Synchronous and pure apart
        from publishing to the cache."""
        started = time.perf_counter()
        keys = (
            set(items) | set(self._objects) | set(self._endpoints)
            if full_resync or changed is None
            else changed
        )
        fast = (
            not full_resync
            and changed is not None
            and self.plan is not None
            and all(key.startswith(FAST_PATH_PREFIXES) for key in changed)
        )
        for key in keys:
            self._apply(key, items.get(key))
        state = self._state()
        plan = compile_plan(state)
        fleets: dict[str, dict[str, str]] = {}
        for fleet_plan in plan.fleets:
            previous = self.cache.snapshot_for(fleet_plan.fleet) if fast else None
            if previous is not None and fleet_plan.fleet in self.cache.fleets():
                snapshot = previous.with_messages(
                    resources.ENDPOINT,
                    [translate_endpoints(cluster) for cluster in fleet_plan.clusters],
                    replace_all=True,
                )
            else:
                snapshot = Snapshot.from_messages(translate(fleet_plan).by_type())
            self.cache.set_snapshot(fleet_plan.fleet, snapshot)
            fleets[fleet_plan.fleet] = snapshot.versions()
        for stale in set(self.cache.fleets()) - set(fleets) - {DEFAULT_FLEET}:
            self.cache.delete_snapshot(stale)
        self._report(plan)
        self.plan = plan
        elapsed = time.perf_counter() - started
        self.last_build = BuildInfo(
            revision=revision, at=time.time(), seconds=elapsed, fast_path=fast, fleets=fleets
        )
        self.metrics.builds.labels("fast" if fast else "full").inc()
        self.metrics.build_seconds.observe(elapsed)
        self._built.set()
        log.debug(
            "rebuilt at revision %d in %.1f ms (%s path)",
            revision,
            elapsed * 1000,
            "fast" if fast else "full",
        )

    def _apply(self, key: str, kv: KeyValue | None) -> None:
        parts = key.split("/")
        if parts[0] == "objects" and len(parts) == 3:
            self._apply_object(key, parts[1], kv)
        elif parts[0] == "endpoints" and len(parts) == 3:
            self._apply_endpoint(key, kv)

    def _apply_object(self, key: str, path: str, kv: KeyValue | None) -> None:
        if kv is None:
            self._objects.pop(key, None)
            self.errors.pop(key, None)
            return
        try:
            obj = parse_object(json.loads(kv.value), source=key)
            name = key.rsplit("/", 1)[1]
            if PATH_KIND.get(path) != obj.kind or obj.metadata.name != name:
                raise PolicyError(
                    [],
                    f"{key}: holds {obj.kind} {obj.metadata.name!r}, not a {PATH_KIND.get(path)} named {name!r}",
                )
        except (ValueError, PolicyError) as error:
            self._reject(key, kv, str(error))
            return
        self._objects[key] = obj
        self.errors.pop(key, None)

    def _apply_endpoint(self, key: str, kv: KeyValue | None) -> None:
        if kv is None:
            self._endpoints.pop(key, None)
            self.errors.pop(key, None)
            return
        try:
            endpoint = Endpoint.model_validate_json(kv.value)
        except ValueError as error:
            self._reject(key, kv, str(error))
            return
        self._endpoints[key] = endpoint
        self.errors.pop(key, None)

    def _reject(self, key: str, kv: KeyValue, message: str) -> None:
        serving = key in self._objects or key in self._endpoints
        known = self.errors.get(key)
        if known is None or known.revision != kv.mod_revision:
            log.error(
                "ignoring invalid value at %s (revision %d): %s%s",
                key,
                kv.mod_revision,
                message,
                "; its last valid version keeps serving" if serving else "",
            )
        self.errors[key] = ObjectError(key, message, kv.mod_revision, serving)

    def _state(self) -> PolicyState:
        pools: dict[str, Pool] = {}
        policies: dict[str, RoutingPolicy] = {}
        fleets: dict[str, Fleet] = {}
        for obj in self._objects.values():
            if isinstance(obj, Pool):
                pools[obj.metadata.name] = obj
            elif isinstance(obj, RoutingPolicy):
                policies[obj.metadata.name] = obj
            else:
                fleets[obj.metadata.name] = obj
        registered: dict[str, dict[str, Endpoint]] = {}
        for key, endpoint in self._endpoints.items():
            _, pool, endpoint_id = key.split("/")
            registered.setdefault(pool, {})[endpoint_id] = endpoint
        return PolicyState(pools=pools, policies=policies, fleets=fleets, registered=registered)

    def _report(self, plan: RoutingPlan) -> None:
        previous = set(self.plan.diagnostics) if self.plan is not None else set()
        for diagnostic in plan.diagnostics:
            if diagnostic not in previous:
                level = logging.ERROR if diagnostic.severity == "error" else logging.WARNING
                log.log(level, "%s", diagnostic)
        self.metrics.invalid_objects.set(len(self.errors))
        for severity in ("error", "warning"):
            self.metrics.diagnostics.labels(severity).set(
                sum(1 for d in plan.diagnostics if d.severity == severity)
            )
