"""Every example policy, applied with `kvpilot apply -f`, is accepted by a real Envoy over ADS:
no update of any type is rejected, and every listener is served."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.auth import ADMIN_TOKEN
from harness.envoy import active_listeners
from harness.rig import api_client
from harness.wait import wait_until

from commands.cli import main as kvpilot_cli
from controlplane.local import EmbeddedEnvoy, free_port, repo_root

pytestmark = pytest.mark.e2e

EXAMPLES = repo_root() / "policies" / "examples"
SECRET_FILE = {
    "resources": [
        {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
            "name": "provider-key",
            "generic_secret": {"secret": {"inline_string": "Bearer example"}},
        }
    ]
}


def rejected_updates(envoy: EmbeddedEnvoy) -> dict[str, int | str]:
    stats = envoy.stats().items()
    return {name: value for name, value in stats if name.endswith("update_rejected") and value}


def stage_examples(tmp_path: Path) -> tuple[Path, dict[str, set[str]]]:
    """The examples, staged for one test: every fleet's secrets directory points at a test
    directory that holds the provider's secret file (fleets go first: Envoy rejects a
    credential listener whose secret file does not exist on its host), and every policy's
    listener port is a free one. Returns the directory and, by fleet name (or "*"), the
    listeners its policies serve."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "provider-key.yaml").write_text(json.dumps(SECRET_FILE))
    staged = tmp_path / "policies"
    staged.mkdir()
    fleets: list[dict[str, Any]] = [{"kind": "Fleet", "metadata": {"name": "default"}}]
    listeners: dict[str, set[str]] = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
        fleets += [d for d in documents if d["kind"] == "Fleet"]
        others = [d for d in documents if d["kind"] != "Fleet"]
        for policy in (d for d in others if d["kind"] == "RoutingPolicy"):
            port = free_port()
            policy["spec"]["listener"]["port"] = port
            for fleet in policy["spec"].get("fleets", ["default"]):
                listeners.setdefault(fleet, set()).add(f"listener-{port}")
        (staged / path.name).write_text(yaml.safe_dump_all(others))
    for fleet in fleets:
        fleet.setdefault("spec", {})["secretsDir"] = str(secrets)
    (staged / "00-fleets.yaml").write_text(yaml.safe_dump_all(fleets))
    return staged, listeners


def test_all_examples_applied_through_the_cli_are_accepted_by_envoy(
    tmp_path: Path, etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any
) -> None:
    """One kvpilot serves an Envoy of each fleet the examples name (`default` and `edge`); a
    listener for every fleet ("*") is bound by both, on the same port (SO_REUSEPORT)."""
    kvpilot = kvpilot_factory(etcd_prefix)
    envoys = {
        fleet: envoy_factory(xds_port=kvpilot.xds_port, fleet=fleet)
        for fleet in ("default", "edge")
    }
    staged, listeners = stage_examples(tmp_path)
    command = ["--server", kvpilot.api_url, "--token", ADMIN_TOKEN, "apply", "-f", str(staged)]
    assert kvpilot_cli(command) == 0

    for fleet, envoy in envoys.items():
        expected = listeners.get(fleet, set()) | listeners.get("*", set())
        assert len(expected) >= 2, listeners  # each fleet is served more than one example
        wait_until(
            lambda envoy=envoy, expected=expected: expected <= active_listeners(envoy),
            30,
            message=f"fleet {fleet}'s Envoy to serve the listeners {sorted(expected)}",
        )
        assert rejected_updates(envoy) == {}, fleet
    api = api_client(kvpilot)
    status = api.get("/v1/status").json()
    assert not status["invalidObjects"], status["invalidObjects"]
    assert not [d for d in status["diagnostics"] if d["severity"] == "error"], status
