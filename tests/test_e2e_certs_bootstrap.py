"""The newcomer's path, end to end: `kvpilot certs` makes the certificates, `kvpilot serve`
runs with the flags it printed, and an Envoy started from `kvpilot bootstrap`'s output (as
`envoy -c FILE --use-dynamic-base-id`, its node from the file) connects over mutual TLS,
receives its fleet and routes a chat request to a simulated replica. The same certificate
claiming another fleet gets nothing, and /v1/status says why.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.builders import policy, pool, route
from harness.envoy import active_listeners
from harness.rig import BackendFactory, api_client, apply, ports_of
from harness.traffic import replicas_behind
from harness.wait import wait_until

from compiler.compile import listener_name
from controlplane.local import EmbeddedEnvoy, find_binary, free_port
from xdsserver.identity import TlsFiles

pytestmark = pytest.mark.e2e

TRUST_DOMAIN = "kvpilot.test"


def kvpilot(*argv: str) -> str:
    """Run the `kvpilot` command as a user would; its stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "commands.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


class GeneratedEnvoy(EmbeddedEnvoy):
    """An Envoy run from a bootstrap `kvpilot bootstrap` printed, exactly as printed: no
    `--service-node`/`--service-cluster`, so node.id and node.cluster come from the file."""

    def __init__(self, state_dir: Path, bootstrap: str, *, node_id: str, fleet: str) -> None:
        super().__init__(state_dir, xds_address="", xds_port=0, node_id=node_id, fleet=fleet)
        self.bootstrap = bootstrap

    def render(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap_path.write_text(self.bootstrap)
        return self.bootstrap_path

    def _argv(self) -> list[str]:
        return [
            str(find_binary("envoy")),
            "-c",
            str(self.bootstrap_path),
            "--use-dynamic-base-id",
            # Only so the test learns the admin port the bootstrap's port 0 got.
            "--admin-address-path",
            str(self._admin_address_path),
            "--log-level",
            self.log_level,
        ]


@pytest.fixture
def generated_envoys() -> Iterator[list[GeneratedEnvoy]]:
    """Envoys a test started from generated bootstraps; all stop at teardown."""
    started: list[GeneratedEnvoy] = []
    yield started
    for envoy in started:
        envoy.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`kvpilot certs` run once for the module (the directory and what it printed): both ADS
    modes' tests read the same certificates, which no test changes."""
    pki = tmp_path_factory.mktemp("pki")
    report = kvpilot(
        "certs", "--out", str(pki), "--fleet", "fleet-a", "--fleet", "fleet-b",
        "--trust-domain", TRUST_DOMAIN,
    )  # fmt: skip
    return pki, report


def served_flags(report: str, flag: str) -> list[str]:
    """The values of `flag` in the `kvpilot serve` command `kvpilot certs` printed."""
    return re.findall(rf"{re.escape(flag)} (\S+)", report)


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_envoy_from_bootstrap_with_certs_receives_its_fleet_and_only_its_fleet(
    tmp_path: Path,
    certs: tuple[Path, str],
    etcd_prefix: str,
    kvpilot_factory: Any,
    backends: BackendFactory,
    generated_envoys: list[GeneratedEnvoy],
    delta: bool,
) -> None:
    pki, report = certs
    (cert,), (key,), (client_ca,) = (
        served_flags(report, flag) for flag in ("--xds-cert", "--xds-key", "--xds-client-ca")
    )
    bindings = served_flags(report, "--xds-identity-fleet")
    assert bindings == [
        f"spiffe://{TRUST_DOMAIN}/fleet/fleet-a=fleet-a",
        f"spiffe://{TRUST_DOMAIN}/fleet/fleet-b=fleet-b",
    ]
    server = kvpilot_factory(
        etcd_prefix,
        xds_tls=TlsFiles(Path(cert), Path(key), Path(client_ca)),
        xds_identity_fleets=bindings,
    )
    api = api_client(server)
    replicas = backends(2, id_prefix="tls")
    ports = {"fleet-a": free_port(), "fleet-b": free_port()}
    apply(
        api,
        pool("sim", ports_of(replicas), models=["sim-model"]),
        *(
            policy(fleet, port, [route("sim", name="r")], fleets=[fleet])
            for fleet, port in ports.items()
        ),
    )
    for fleet in ports:
        wait_until(
            lambda fleet=fleet: (
                api.get(f"/v1/fleets/{fleet}/config").json().get("servedFrom") == fleet
            ),
            30,
            message=f"{fleet}'s policy to be compiled",
        )

    def start(fleet: str, tls_dir: Path, node_id: str) -> GeneratedEnvoy:
        flags = ["--delta"] if delta else []
        bootstrap = kvpilot(
            "bootstrap", "--fleet", fleet, "--xds", f"127.0.0.1:{server.xds_port}",
            "--tls-dir", str(tls_dir), "--node-id", node_id, "--admin-port", "0", *flags,
        )  # fmt: skip
        envoy = GeneratedEnvoy(tmp_path / node_id, bootstrap, node_id=node_id, fleet=fleet)
        generated_envoys.append(envoy)
        return envoy.start()

    # Fleet A's certificate and fleet A's bootstrap: fleet A's listener, and traffic flows.
    envoy_a = start("fleet-a", pki / "envoy-fleet-a", "edge-1")
    wait_until(
        lambda: active_listeners(envoy_a) == {listener_name(ports["fleet-a"])},
        30,
        message="the Envoy of fleet A to receive fleet A's listener (and only it)",
    )
    wait_until(
        lambda: replicas_behind(ports["fleet-a"]) == {r.id for r in replicas.replicas},
        30,
        message="chat requests through fleet A's Envoy to reach both replicas",
    )
    status = api.get("/v1/status").json()
    connected = {e["node_id"]: e for e in status["envoys"]}
    assert connected["edge-1"]["identity"] == f"spiffe://{TRUST_DOMAIN}/fleet/fleet-a"
    assert connected["edge-1"]["fleet"] == "fleet-a"

    # Fleet A's certificate with a bootstrap claiming fleet B: refused, and it gets nothing.
    claims_b = start("fleet-b", pki / "envoy-fleet-a", "edge-2")

    def refused() -> dict[str, Any] | None:
        found = [
            r for r in api.get("/v1/status").json()["refusedEnvoys"] if r["node_id"] == "edge-2"
        ]
        return found[0] if found else None

    refusal = wait_until(refused, 30, message="the fleet-B claim to show as refused")
    assert refusal["reason"] == "fleet_mismatch"
    assert refusal["identity"] == f"spiffe://{TRUST_DOMAIN}/fleet/fleet-a"
    assert active_listeners(claims_b) == set()
    assert "edge-2" not in {e["node_id"] for e in api.get("/v1/status").json()["envoys"]}
