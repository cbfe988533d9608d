"""The commands on top, run as a user runs them: `make demo`, and `kvpilot serve` on its
embedded etcd default routing real traffic (test_serve_embedded.py checks that serve prints and
reports that etcd's address)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
from harness.auth import ADMIN
from harness.builders import FAST_HEALTH_CHECK, policy, pool
from harness.processes import processes_with_env
from harness.rig import Rig
from harness.traffic import send
from harness.wait import wait_until

from controlplane.local import free_port, repo_root

MARKER = "KVPILOT_TEST_RUN"
"""An environment variable set on a command under test: everything it starts inherits it."""


def replica_counts(table: str) -> dict[str, int]:
    """Replica -> requests, from one of the demo's tables."""
    return {
        name: int(count) for name, count in re.findall(r"^\s+(replica-\d+)\s+(\d+)\s", table, re.M)
    }


def test_make_demo_moves_traffic_and_leaves_nothing_running(tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex
    # The demo as `make demo` runs it, with the interpreter running the tests (BIN) and
    # without the install step (-o: the virtualenv is the suite's business, not the demo's).
    result = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed-local", "demo",
         f"BIN={Path(sys.executable).parent}",
         f"DEMO_ARGS=--state-dir {tmp_path} --requests 40"],
        cwd=repo_root(), env={**os.environ, MARKER: run_id},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    steps = re.split(r"^\d\. ", result.stdout, flags=re.M)
    assert len(steps) == 5, result.stdout
    equal, weighted, removed = (replica_counts(step) for step in steps[2:5])
    # 40 requests, round robin over three equal weights, then 800:100:100, then two replicas
    # left: replica-0 takes most once its weight is 800 (about 32 of 40), replica-2 none once
    # removed.
    assert set(equal) == {"replica-0", "replica-1", "replica-2"} and min(equal.values()) >= 10
    assert weighted["replica-0"] >= 24, weighted
    assert removed.get("replica-2", 0) == 0 and sum(removed.values()) == 40, removed
    # It ends with what to try next: the console, a request through Envoy, a weight change,
    # the quickstart.
    tail = result.stdout.split("What to try next", 1)[-1]
    for what in ("/ui/", "curl -s http://127.0.0.1:", "set-weight demo-pool", "docs/quickstart.md"):
        assert what in tail, result.stdout[-2000:]
    wait_until(
        lambda: not processes_with_env(MARKER, run_id),
        60,
        message="every process the demo started to be gone",
    )


def test_make_demo_installs_the_local_extra_only_and_make_test_the_development_extras(
    tmp_path: Path,
) -> None:
    """On a fresh clone (no virtualenv yet) `make demo` installs `[local]` and nothing for
    development; `make test` installs `[dev]`. `make -n` prints the recipes without running."""

    def recipes(target: str) -> list[str]:
        result = subprocess.run(
            ["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}"],
            cwd=repo_root(), capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return [line for line in result.stdout.splitlines() if "pip install" in line]

    demo = recipes("demo")
    assert len(demo) == 1 and "'.[local]'" in demo[0], demo
    assert not any("[dev]" in line or "[bench]" in line for line in demo), demo
    assert any("'.[dev]'" in line for line in recipes("test"))


def test_serve_on_its_embedded_etcd_routes_traffic_and_keeps_its_data(
    etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, backends: Any
) -> None:
    replicas = backends(2, id_prefix="emb")
    ports = [replica.port for replica in replicas.replicas]
    kvpilot = kvpilot_factory(etcd_prefix, etcd_endpoints=[], env={MARKER: etcd_prefix})
    etcd_dir = str(kvpilot.state_dir / "etcd")

    def embedded_etcd() -> list[int]:
        return [
            pid
            for pid in processes_with_env(MARKER, etcd_prefix)
            if etcd_dir in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        ]

    assert embedded_etcd(), "serve started no etcd under its state directory"
    envoy = envoy_factory(xds_port=kvpilot.xds_port)
    with httpx.Client(base_url=kvpilot.api_url, headers=ADMIN, timeout=30) as api:
        rig = Rig(kvpilot, envoy, api, free_port())
        rig.apply(
            pool("llm", ports, health_check=FAST_HEALTH_CHECK),
            policy("chat", rig.listener_port, [{"name": "all", "tiers": [["llm"]]}]),
        )
        rig.wait_ready("chat/all", ports, timeout=60)
        with httpx.Client(timeout=30) as client:
            served = send(client, rig.url(), 20)
        assert {status for status, _ in served} == {200}, served
        assert {replica for _, replica in served} == {"emb-0", "emb-1"}, served

        # Stopping serve stops its etcd; started again on the same state directory, the
        # objects are still there.
        kvpilot.stop()
        wait_until(lambda: not embedded_etcd(), 60, message="the embedded etcd to stop")
        kvpilot.start(60)
        assert api.get("/v1/pools/llm").status_code == 200
        assert api.get("/v1/routingpolicies/chat").status_code == 200
