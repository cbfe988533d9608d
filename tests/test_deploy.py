"""The deployment files agree with the code: every kvpilot flag they pass exists, Envoy gets
the bootstrap from deploy/envoy at the path it is mounted, and the xDS port lines up.

These files cannot run here (no Docker engine, no cluster), so this is what can be checked."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from commands import serve
from controlplane.local import XDS_TLS_DIR, XDS_TLS_SDS_DIR, repo_root

DEPLOY = repo_root() / "deploy"


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    serve.add_arguments(parser)
    return parser


def parse_serve(args: list[str]) -> argparse.Namespace:
    assert args[0] == "serve", args
    return serve_parser().parse_args(args[1:])


def kubernetes_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def containers(name: str) -> list[dict[str, Any]]:
    return [
        container
        for doc in kubernetes_documents()
        if doc["kind"] == "Deployment"
        for container in doc["spec"]["template"]["spec"]["containers"]
        if container["name"] == name
    ]


def mounts_config(container: dict[str, Any], path: str) -> str:
    """The name of the ConfigMap mounted at `path` in a Deployment's pod."""
    [volume_name] = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == path]
    for doc in kubernetes_documents():
        for volume in doc.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if volume["name"] == volume_name and "configMap" in volume:
                return str(volume["configMap"]["name"])
    raise AssertionError(f"no ConfigMap volume {volume_name!r}")


def xds_port_of_bootstrap() -> int:
    bootstrap = yaml.safe_load((DEPLOY / "envoy" / "bootstrap.yaml").read_text())
    [cluster] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvpilot_xds"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    address = endpoint["address"]["socket_address"]
    assert address["address"] == "kvpilot"
    return int(address["port_value"])


def test_dockerfile_default_command_is_a_valid_serve_invocation() -> None:
    lines = (repo_root() / "Dockerfile").read_text().splitlines()
    [cmd] = [line for line in lines if line.startswith("CMD ")]
    args = yaml.safe_load(cmd.removeprefix("CMD "))
    config = serve.config_from_args(parse_serve(args))
    assert config.xds_port == xds_port_of_bootstrap()


def test_compose_services_agree() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    config = serve.config_from_args(parse_serve(compose["kvpilot"]["command"]))
    assert config.xds_port == xds_port_of_bootstrap()
    assert config.etcd_endpoints == ["etcd:2379"]
    envoy_args = compose["envoy"]["command"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in compose["envoy"]["volumes"]}
    config_path = envoy_args[envoy_args.index("-c") + 1]
    assert (DEPLOY / mounted[config_path]).resolve() == DEPLOY / "envoy" / "bootstrap.yaml"
    assert any(a.startswith("--service-cluster=") for a in envoy_args)
    assert config.xds_tls is not None and config.xds_identity_fleets
    kvpilot_mounts = {v.split(":")[1] for v in compose["kvpilot"]["volumes"]}
    assert str(config.xds_tls.cert.parent) in kvpilot_mounts
    assert {XDS_TLS_DIR, XDS_TLS_SDS_DIR} <= set(mounted)


def test_kubernetes_kvpilot_and_envoy_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    [kvpilot] = containers("kvpilot")
    # The container's env supplies the etcd password from a Secret.
    monkeypatch.setenv("KVPILOT_ETCD_PASSWORD", "from-the-secret")
    config = serve.config_from_args(parse_serve(kvpilot["args"]))
    ports = {p["name"]: p["containerPort"] for p in kvpilot["ports"]}
    assert ports["xds"] == config.xds_port == xds_port_of_bootstrap()
    assert ports["http"] == config.api_port
    assert kvpilot["readinessProbe"]["httpGet"]["path"] == "/readyz"
    [service] = [
        d
        for d in kubernetes_documents()
        if d["kind"] == "Service" and d["metadata"]["name"] == "kvpilot"
    ]
    assert {p["port"] for p in service["spec"]["ports"]} >= {config.xds_port}

    [envoy] = containers("envoy")
    config_path = envoy["args"][envoy["args"].index("-c") + 1]
    mounts = {m["mountPath"]: m["name"] for m in envoy["volumeMounts"]}
    assert mounts[str(Path(config_path).parent)] == "bootstrap"
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    generators = {g["name"]: g for g in kustomization["configMapGenerator"]}
    key, _, source = generators["envoy-bootstrap"]["files"][0].partition("=")
    assert key == Path(config_path).name and (DEPLOY / source).is_file()
    # ADS over mutual TLS: kvpilot's files are mounted where its flags point, and Envoy gets
    # its certificate and the SDS files where the bootstrap reads them.
    kvpilot_mounts = {m["mountPath"] for m in kvpilot["volumeMounts"]}
    assert config.xds_tls is not None
    assert {str(config.xds_tls.cert.parent), str(config.xds_tls.client_ca.parent)} <= kvpilot_mounts
    etcd_tls = config.etcd_security
    assert etcd_tls.ca is not None and etcd_tls.cert is not None and etcd_tls.user
    assert {str(etcd_tls.ca.parent), str(etcd_tls.cert.parent)} <= kvpilot_mounts
    assert "KVPILOT_ETCD_PASSWORD" in {e["name"] for e in kvpilot["env"]}
    assert {XDS_TLS_DIR, XDS_TLS_SDS_DIR} <= set(mounts)
    sds_files = {
        f.partition("=")[0] for f in generators[mounts_config(envoy, XDS_TLS_SDS_DIR)]["files"]
    }
    assert sds_files == {p.name for p in (DEPLOY / "envoy" / "xds-tls").glob("*.yaml")}
    assert all((DEPLOY / resource).is_file() for resource in kustomization["resources"])


@pytest.mark.parametrize("flag", ["--no-such-flag=1"])
def test_an_unknown_flag_would_be_caught(flag: str) -> None:
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parse_serve(shlex.split(f"serve {flag}"))


def test_serve_durations_are_seconds_zero_or_more() -> None:
    plain = ["serve", "--xds-insecure-plaintext"]
    config = serve.config_from_args(parse_serve([*plain, "--telemetry-push-interval", "0.5"]))
    assert config.telemetry_push_interval == 0.5
    assert serve.config_from_args(parse_serve(plain)).telemetry_push_interval == 1.0
    for flag in ("--telemetry-push-interval", "--quiet-period", "--max-wait"):
        for bad in ("-1", "nan", "inf", "soon"):
            with pytest.raises(argparse.ArgumentError, match="seconds"):
                parse_serve(["serve", flag, bad])
