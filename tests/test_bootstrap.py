"""The shipped Envoy bootstraps, and the ones EmbeddedEnvoy renders from them, are valid."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from controlplane.local import EmbeddedEnvoy, LauncherError, find_binary, free_port, repo_root
from controlplane.local.pki import Ca, CertDir

BOOTSTRAPS = ["bootstrap.yaml", "bootstrap-delta.yaml"]


def validate(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(find_binary("envoy")),
            "--mode",
            "validate",
            "-c",
            str(config),
            "--service-node",
            "n",
            "--service-cluster",
            "c",
            "--use-dynamic-base-id",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_shipped_bootstrap_with_its_xds_tls_validates(tmp_path: Path, delta: bool) -> None:
    """The shipped bootstrap as it is, only its /etc/envoy/xds-tls* paths moved to files that
    exist here (Envoy's validate mode checks that SDS paths exist)."""
    ca = Ca()
    certs = CertDir(tmp_path / "xds-tls", ca.issue("envoy", uris=("spiffe://t/fleet/c",)), ca.cert)
    envoy = EmbeddedEnvoy(
        tmp_path / "envoy",
        xds_address="127.0.0.1",
        xds_port=free_port(),
        node_id="n",
        fleet="c",
        delta=delta,
        xds_tls_dir=certs.path,
    )
    config = yaml.safe_load(envoy.render().read_text())
    (xds,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "kvpilot_xds"]
    sds = xds["transport_socket"]["typed_config"]["common_tls_context"]
    path = sds["tls_certificate_sds_secret_configs"][0]["sds_config"]["path_config_source"]["path"]
    assert Path(path).is_relative_to(envoy.state_dir)
    assert str(certs.cert) in Path(path).read_text()
    result = validate(envoy.bootstrap_path)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_rendered_bootstrap_validates(tmp_path: Path, delta: bool) -> None:
    envoy = EmbeddedEnvoy(
        tmp_path, xds_address="127.0.0.1", xds_port=free_port(), node_id="n", fleet="c", delta=delta
    )
    result = validate(envoy.render())
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    ("name", "api_type"), [(BOOTSTRAPS[0], "GRPC"), (BOOTSTRAPS[1], "DELTA_GRPC")]
)
def test_rendered_bootstrap_points_at_the_control_plane(
    tmp_path: Path, name: str, api_type: str
) -> None:
    envoy = EmbeddedEnvoy(
        tmp_path,
        xds_address="127.0.0.2",
        xds_port=18123,
        node_id="n",
        fleet="c",
        delta=name.endswith("-delta.yaml"),
        admin_port=19901,
    )
    config = yaml.safe_load(envoy.render().read_text())
    assert config["dynamic_resources"]["ads_config"]["api_type"] == api_type
    (xds,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "kvpilot_xds"]
    address = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "127.0.0.2", "port_value": 18123}
    assert config["admin"]["address"]["socket_address"]["port_value"] == 19901
    assert envoy.admin_url == "http://127.0.0.1:19901"


def test_missing_template_says_where_deploy_lives(tmp_path: Path) -> None:
    envoy = EmbeddedEnvoy(
        tmp_path,
        xds_address="127.0.0.1",
        xds_port=1,
        node_id="n",
        fleet="c",
        bootstrap=tmp_path / "absent.yaml",
    )
    with pytest.raises(LauncherError, match="bootstrap=PATH"):
        envoy.render()


def _seconds(value: str) -> float:
    return float(value.removesuffix("s"))


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_envoys_retry_the_control_plane_within_a_bounded_backoff(
    tmp_path: Path, delta: bool
) -> None:
    # Envoy's default xDS reconnect backoff grows to 30 s: after a control-plane outage an
    # Envoy took up to 21 s to come back. Shipped and rendered bootstraps bound it.
    envoy = EmbeddedEnvoy(
        tmp_path, xds_address="127.0.0.1", xds_port=free_port(), node_id="n", fleet="c", delta=delta
    )
    for path in (repo_root() / "deploy" / "envoy" / BOOTSTRAPS[delta], envoy.render()):
        config = yaml.safe_load(path.read_text())
        [service] = config["dynamic_resources"]["ads_config"]["grpc_services"]
        backoff = service["envoy_grpc"]["retry_policy"]["retry_back_off"]
        assert _seconds(backoff["base_interval"]) <= 0.5, path
        assert _seconds(backoff["max_interval"]) <= 5, path
