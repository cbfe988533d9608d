"""The reconciler's rebuild paths, in process: which path a change takes, that a partial path
re-serializes only what it must, and that its result equals a full translation."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from harness.wait import poll

from controlplane.etcd import KeyValue
from controlplane.local import repo_root
from controlplane.mirror import StateChange
from controlplane.reconcile.loop import Reconciler
from policies import KIND_PATHS, load_objects
from xdsserver import resources
from xdsserver.snapshot import Snapshot, SnapshotCache
from xdsserver.translate import translate

EXAMPLE = repo_root() / "policies" / "examples" / "llm-fleet.yaml"
ALL_TYPES = (resources.CLUSTER, resources.ENDPOINT, resources.LISTENER, resources.ROUTE)


class Items(dict[str, KeyValue]):
    """etcd's view: relative key -> KeyValue, with a revision counter."""

    revision = 0

    def put(self, key: str, body: dict[str, Any]) -> str:
        self.revision += 1
        value = json.dumps(body).encode()
        self[key] = KeyValue(key.encode(), value, self.revision, self.revision, 1, 0)
        return key

    def body(self, key: str) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self[key].value)
        return loaded


@pytest.fixture
def built() -> tuple[Reconciler, Items]:
    items = Items()
    for obj in load_objects(EXAMPLE):
        body = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
        items.put(f"objects/{KIND_PATHS[obj.kind]}/{obj.metadata.name}", body)
    reconciler = Reconciler(SnapshotCache())
    reconciler.rebuild(items)
    assert reconciler.last_build.path == "full"
    assert reconciler.plan is not None
    assert {fleet.fleet for fleet in reconciler.plan.fleets} == {"default", "edge"}
    return reconciler, items


def snapshots(reconciler: Reconciler) -> dict[str, Snapshot]:
    assert reconciler.plan is not None
    out = {}
    for fleet in reconciler.plan.fleets:
        snapshot = reconciler.cache.snapshot_for(fleet.fleet)
        assert snapshot is not None
        out[fleet.fleet] = snapshot
    return out


def assert_equals_full_translation(reconciler: Reconciler) -> None:
    """What a partial path built is exactly what translating the whole plan builds."""
    assert reconciler.plan is not None
    for fleet in reconciler.plan.fleets:
        full = Snapshot.from_messages(translate(fleet).by_type())
        served = reconciler.cache.snapshot_for(fleet.fleet)
        assert served is not None
        for type_url in ALL_TYPES:
            assert {n: r.version for n, r in served.resources(type_url).items()} == {
                n: r.version for n, r in full.resources(type_url).items()
            }, (fleet.fleet, type_url)
        assert served.versions() == full.versions()


def test_a_route_change_rebuilds_listeners_and_routes_only(
    built: tuple[Reconciler, Items],
) -> None:
    reconciler, items = built
    before = snapshots(reconciler)
    key = "objects/routingpolicies/inference"
    body = items.body(key)
    body["spec"]["routes"][0]["timeouts"]["request"] = "300s"
    reconciler.rebuild(items, changed={items.put(key, body)}, full_resync=False)

    assert reconciler.last_build.path == "routes"
    assert_equals_full_translation(reconciler)
    for fleet, after in snapshots(reconciler).items():
        assert after.version(resources.ROUTE) != before[fleet].version(resources.ROUTE)
        for type_url in (resources.CLUSTER, resources.ENDPOINT):
            # Reused, not re-serialized: the very same Resource objects.
            old, new = before[fleet].resources(type_url), after.resources(type_url)
            assert all(new[name] is old[name] for name in old) and new.keys() == old.keys()
        # The provider's credential listener survives a route change.
        assert set(after.resources(resources.LISTENER)) == {
            "listener-10001",
            "inference/llama/provider/provider/internal",
        }


def test_an_endpoint_change_takes_the_fast_path(built: tuple[Reconciler, Items]) -> None:
    reconciler, items = built
    key = "objects/pools/qwen-7b"
    body = items.body(key)
    body["spec"]["endpoints"][0]["weight"] = 7
    reconciler.rebuild(items, changed={items.put(key, body)}, full_resync=False)
    assert reconciler.last_build.path == "fast"
    assert_equals_full_translation(reconciler)


def test_a_cluster_change_translates_everything(built: tuple[Reconciler, Items]) -> None:
    reconciler, items = built
    key = "objects/routingpolicies/inference"
    body = items.body(key)
    body["spec"]["routes"][1]["balancing"] = "least_request"  # the cluster's LB policy
    reconciler.rebuild(items, changed={items.put(key, body)}, full_resync=False)
    assert reconciler.last_build.path == "full"
    assert_equals_full_translation(reconciler)


def test_a_fleet_secrets_dir_change_is_not_a_route_change(
    built: tuple[Reconciler, Items],
) -> None:
    # The credential listener reads its secret from the fleet's secretsDir.
    reconciler, items = built
    key = "objects/fleets/edge"
    body = items.body(key)
    body["spec"]["secretsDir"] = "/run/other-secrets"
    reconciler.rebuild(items, changed={items.put(key, body)}, full_resync=False)
    assert reconciler.last_build.path == "full"
    assert_equals_full_translation(reconciler)


async def test_a_lone_change_is_built_at_once_and_a_burst_is_folded(
    built: tuple[Reconciler, Items],
) -> None:
    """Debounce with a leading edge: a change that finds the reconciler idle does not wait
    out the quiet period; one that follows a rebuild within it does."""
    _, items = built
    quiet = 2.0
    reconciler = Reconciler(SnapshotCache(), quiet_period=quiet, max_wait=4 * quiet)
    reconciler.rebuild(items)
    await asyncio.sleep(quiet)  # idle for a quiet period, as a daemon between changes

    def change(weight: int) -> float:
        key = "objects/pools/qwen-7b"
        body = items.body(key)
        body["spec"]["endpoints"][0]["weight"] = weight
        items.put(key, body)
        reconciler.on_change(StateChange(items.revision, frozenset({key}), False), items)
        return time.monotonic()

    async def built_after(since: float) -> float:
        await poll(lambda: reconciler.last_build.revision == items.revision, 4 * quiet)
        return time.monotonic() - since

    task = asyncio.create_task(reconciler.run())
    try:
        lone = await built_after(change(7))
        assert lone < quiet, f"a lone change waited {lone:.2f}s, the quiet period is {quiet}s"
        folded = await built_after(change(8))
        assert folded >= quiet, "a change right after a rebuild is debounced"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_reconciler_cancelled_as_a_change_arrives_stops(
    built: tuple[Reconciler, Items],
) -> None:
    """A cancellation that lands in the same step as a change, while the loop waits for fresh
    telemetry to go stale, ends the loop: the daemon's shutdown waits for it."""
    reconciler, items = built
    policy = items.body("objects/routingpolicies/inference")
    policy["spec"]["routes"][0]["balancing"] = "telemetry"
    items.put("objects/routingpolicies/inference", policy)

    def report(endpoint: str, waiting: int) -> str:
        return items.put(
            f"telemetry/llama-70b-a/{endpoint}", {"at": time.time(), "waiting": waiting}
        )

    for endpoint, waiting in (("10.0.1.10:8000", 0), ("10.0.1.11:8000", 8), ("10.0.1.12:8000", 0)):
        report(endpoint, waiting)
    reconciler.rebuild(items)
    assert reconciler._live.due_at < float("inf")  # the loop waits with a deadline
    task = asyncio.create_task(reconciler.run())
    await asyncio.sleep(0)  # the loop runs up to that wait
    key = report("10.0.1.11:8000", 0)
    reconciler.on_change(StateChange(items.revision, frozenset({key}), False), items)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):
            await task
