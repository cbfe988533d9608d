"""`python -m bench controlplane --short`: the control-plane benchmark end to end (real etcd,
kvpilot, Envoys and simulated ADS streams).

No timing asserts: this checks that the run completes and its results are well formed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.local import repo_root


@pytest.mark.e2e
def test_short_controlplane_benchmark_writes_well_formed_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "controlplane", "--short", "--out", str(out)],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = out / "controlplane.json"
    assert f"json: {path}" in done.stdout
    assert "| 1 Envoy |" in done.stdout and "| 100 simulated streams |" in done.stdout

    results = json.loads(path.read_text())
    rows = {row["clients"]: row for row in results["envoys"]}
    assert set(rows) == {
        "1 Envoy",
        "3 Envoy",
        "100 simulated streams",
        "3 Envoy, 1000 endpoints, endpoint change",
        "3 Envoy, 1000 endpoints, route change",
    }
    for name, row in rows.items():
        assert row["changes"] == results["config"]["changes"], name
        assert 0 < row["first_ack_p50_ms"] <= row["p50_ms"] <= row["p99_ms"] <= row["max_ms"], name
        assert row["rss_mib"] > 0, name
    translation = results["translation"]
    assert translation["endpoints"] == 1000
    assert translation["full_rebuild_ms"] > 0 and translation["fast_path_ms"] > 0
    assert translation["routes_path_ms"] > 0
    assert set(results["memory_mib"]) == {"idle", "1000 endpoints", "end"}
    # Nothing changed while the big stack sat idle: kvpilot sent nothing.
    assert results["idle"] == {"seconds": 5.0, "responses": 0, "per_minute": 0}
    assert "0.0 xDS pushes per minute" in done.stdout
