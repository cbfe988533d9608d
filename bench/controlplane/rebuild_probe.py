"""The reconciler's rebuilds, timed in process: a full rebuild, one endpoint changed (the EDS
fast path) and one route timeout changed (the routes path).

Self-contained on purpose: it imports from kvpilot only what every version of it has
(``Reconciler(cache).rebuild(items, changed=..., full_resync=...)``, ``SnapshotCache``,
``KeyValue``), so the side-by-side benchmark (``bench.controlplane.scale``) runs this very file against an
older commit's code, and both sides are timed by the same lines on the same input. Each time is
taken on the wall clock and as the process's CPU time: on a machine that others share, the CPU
time is the steadier of the two (another process taking the core does not count).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

MEASURES = ("first_full_rebuild", "full_rebuild", "fast_path", "routes_path")
"""What `measure` times: the process's first full rebuild (nothing cached yet, as at start),
a full rebuild, one endpoint changed, one route timeout changed."""
CHANGE_KEY = "endpoints/p0/moving"
"""The registered endpoint whose weight the fast path changes (pool ``p0`` exists)."""
POLICY_KEY = "objects/routingpolicies/bench"


def measure(values: dict[str, Any], repeats: int = 5) -> dict[str, Any]:
    """Median wall and CPU milliseconds of each rebuild in `MEASURES`, over `repeats` runs,
    for the state `values` (etcd key relative to the prefix -> JSON value)."""
    from controlplane.etcd import KeyValue
    from controlplane.reconcile.loop import Reconciler
    from xdsserver.snapshot import SnapshotCache

    items: dict[str, Any] = {}
    revision = 0

    def put(key: str, body: Any) -> None:
        nonlocal revision
        revision += 1
        items[key] = KeyValue(key.encode(), json.dumps(body).encode(), revision, revision, 1, 0)

    for key, body in values.items():
        put(key, body)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in MEASURES}

    def timed(name: str, run: Callable[[], None]) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        times[name].append((time.perf_counter() - wall, time.process_time() - cpu))

    reconciler = cache = None
    for index in range(repeats + 1):
        cache = SnapshotCache()
        reconciler = Reconciler(cache)
        name = "first_full_rebuild" if index == 0 else "full_rebuild"
        timed(name, lambda: reconciler.rebuild(items))  # noqa: B023
    assert reconciler is not None and cache is not None
    snapshot = cache.snapshot_for("default")
    assert snapshot is not None
    size = sum(len(r.body.value) for t in snapshot.types() for r in snapshot.resources(t).values())
    for weight in range(1, repeats * 2 + 1):
        put(CHANGE_KEY, {"address": "127.0.0.1", "port": 9, "weight": weight})
        timed(
            "fast_path",
            lambda: reconciler.rebuild(items, changed={CHANGE_KEY}, full_resync=False),
        )
        assert reconciler.last_build.path == "fast", reconciler.last_build.path
    policy = json.loads(items[POLICY_KEY].value)
    for seconds in range(1, repeats * 2 + 1):
        policy["spec"]["routes"][0]["timeouts"] = {"request": f"{seconds}s"}
        put(POLICY_KEY, policy)
        timed(
            "routes_path",
            lambda: reconciler.rebuild(items, changed={POLICY_KEY}, full_resync=False),
        )
        assert reconciler.last_build.path == "routes", reconciler.last_build.path
    result: dict[str, Any] = {
        "clusters": len(snapshot.resources(snapshot.types()[0])),
        "serialized_kib": round(size / 1024),
    }
    for name, samples in times.items():
        result[f"{name}_ms"] = round(statistics.median(w for w, _ in samples) * 1000, 1)
        result[f"{name}_cpu_ms"] = round(statistics.median(c for _, c in samples) * 1000, 1)
    return result


if __name__ == "__main__":
    # Run as `python -c "$(cat rebuild_probe.py)"` from a tree's root, input file and repeats
    # in the environment: the tree's own packages are the ones imported.
    import os
    import sys

    sys.path.insert(0, os.getcwd())
    with open(os.environ["KVPILOT_PROBE_INPUT"]) as f:
        state = json.load(f)
    print(json.dumps(measure(state, int(os.environ.get("KVPILOT_PROBE_REPEATS", "5")))))
