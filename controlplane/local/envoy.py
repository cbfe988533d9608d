"""A real Envoy pointed at a kvpilot xDS server, started from the repo's bootstrap."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import httpx
import yaml

from controlplane.local.launcher import Launcher, default_verify, http_get
from controlplane.local.process import (
    POLL_INTERVAL,
    LauncherError,
    ManagedProcess,
    find_binary,
    repo_root,
)

_XDS_CLUSTER = "kvpilot_xds"
_SIGNALS_CLUSTER = "kvpilot_signals"


def _point(cluster: dict[str, Any], address: str, port: int) -> None:
    cluster["load_assignment"] = {
        "cluster_name": cluster["name"],
        "endpoints": [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {"socket_address": {"address": address, "port_value": port}}
                        }
                    }
                ]
            }
        ],
    }


XDS_TLS_DIR = "/etc/envoy/xds-tls"
"""Where the shipped bootstrap's SDS files expect the Envoy's certificate, key and CA."""
XDS_TLS_SDS_DIR = "/etc/envoy/xds-tls-sds"
"""Where the shipped bootstrap expects the SDS files of deploy/envoy/xds-tls/."""


def _replace_paths(value: Any, paths: Mapping[str, str]) -> Any:
    """`value` with every string that starts with one of `paths` re-rooted (longest first)."""
    if isinstance(value, dict):
        return {k: _replace_paths(v, paths) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_paths(v, paths) for v in value]
    if isinstance(value, str):
        for old in sorted(paths, key=len, reverse=True):
            if value == old or value.startswith(old + "/"):
                return paths[old] + value[len(old) :]
    return value


def render_bootstrap(
    template: Path,
    *,
    xds_address: str,
    xds_port: int,
    admin_port: int,
    admin_address: str = "127.0.0.1",
    signals_port: int | None = None,
    xds_tls_paths: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Load a bootstrap and point its `kvpilot_xds` cluster, its `kvpilot_signals` cluster (the
    access log service; `signals_port`, default the xDS port) and its admin listener at given
    ports.

    `xds_tls_paths` re-roots the TLS file paths of both clusters (`XDS_TLS_DIR`,
    `XDS_TLS_SDS_DIR`); without it their TLS is removed, for a kvpilot run with
    --xds-insecure-plaintext.
    """
    config: dict[str, Any] = yaml.safe_load(template.read_text())
    clusters = config.get("static_resources", {}).get("clusters", [])
    xds = next((c for c in clusters if c.get("name") == _XDS_CLUSTER), None)
    if xds is None:
        raise LauncherError(f"{template} has no static cluster named {_XDS_CLUSTER!r}")
    signals = next((c for c in clusters if c.get("name") == _SIGNALS_CLUSTER), None)
    # The access log service is served by kvpilot's gRPC server, so it shares the xDS TLS.
    for cluster in (xds, signals):
        if cluster is None:
            continue
        if xds_tls_paths is None:
            cluster.pop("transport_socket", None)
        elif "transport_socket" in cluster:
            cluster["transport_socket"] = _replace_paths(cluster["transport_socket"], xds_tls_paths)
    _point(xds, xds_address, xds_port)
    if signals is not None:
        _point(signals, xds_address, signals_port or xds_port)
    config.setdefault("admin", {})["address"] = {
        "socket_address": {"address": admin_address, "port_value": admin_port}
    }
    return config


class EmbeddedEnvoy(Launcher):
    """An Envoy started from the repo's bootstrap, pointed at a kvpilot xDS server.

    With `admin_port=None` the admin listener binds port 0 and Envoy reports the port it got
    (`--admin-address-path`), so parallel Envoys never race for ports; `admin_url` is known once
    `start()` returns.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        xds_address: str,
        xds_port: int,
        node_id: str,
        fleet: str,
        delta: bool = False,
        admin_port: int | None = None,
        bootstrap: Path | None = None,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        signals_port: int | None = None,
        xds_tls_dir: Path | None = None,
        locality: Mapping[str, str] | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.locality = dict(locality or {})
        """The bootstrap's node.locality (``region``, ``zone``), for fleets whose Envoys say
        where they run (``Fleet.spec.nodeLocality``); empty: none."""
        self.xds_tls_dir = xds_tls_dir
        """Holds this Envoy's `tls.crt`, `tls.key` and `ca.crt` for ADS over mutual TLS; None
        connects in plaintext (kvpilot then needs --xds-insecure-plaintext)."""
        self.xds_address = xds_address
        self.xds_port = xds_port
        self.signals_port = signals_port
        """kvpilot gRPC port that access logs go to; default the xDS port."""
        self.node_id = node_id
        self.fleet = fleet
        self.delta = delta
        self.admin_port = admin_port
        name = "bootstrap-delta.yaml" if delta else "bootstrap.yaml"
        self.template = bootstrap or repo_root() / "deploy" / "envoy" / name
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.bootstrap_path = self.state_dir / "envoy-bootstrap.yaml"
        """The rendered bootstrap Envoy runs with."""
        self.log_path = self.state_dir / "envoy.log"
        """Envoy's log (stdout and stderr)."""
        self._admin_address_path = self.state_dir / "envoy-admin-address"
        self._admin_url: str | None = (
            f"http://127.0.0.1:{admin_port}" if admin_port is not None else None
        )
        self._process = None

    @property
    def admin_url(self) -> str:
        """`http://127.0.0.1:PORT` of the admin interface."""
        if self._admin_url is None:
            raise LauncherError("Envoy's admin port is known only after start()")
        return self._admin_url

    def render(self) -> Path:
        """Write the bootstrap for this Envoy to `bootstrap_path` and return that path."""
        if not self.template.is_file():
            raise LauncherError(
                f"Envoy bootstrap template {self.template} not found: deploy/ ships with the "
                "source checkout, not the wheel; pass bootstrap=PATH or run from a checkout"
            )
        paths: dict[str, str] | None = None
        if self.xds_tls_dir is not None:
            sds_dir = self.state_dir / "xds-tls-sds"
            paths = {XDS_TLS_DIR: str(self.xds_tls_dir), XDS_TLS_SDS_DIR: str(sds_dir)}
            sds_dir.mkdir(parents=True, exist_ok=True)
            for source in sorted((self.template.parent / "xds-tls").glob("*.yaml")):
                sds = _replace_paths(yaml.safe_load(source.read_text()), paths)
                (sds_dir / source.name).write_text(yaml.safe_dump(sds, sort_keys=False))
        config = render_bootstrap(
            self.template,
            xds_address=self.xds_address,
            xds_port=self.xds_port,
            admin_port=self.admin_port or 0,
            signals_port=self.signals_port,
            xds_tls_paths=paths,
        )
        if self.locality:
            config.setdefault("node", {})["locality"] = dict(self.locality)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return self.bootstrap_path

    def _argv(self) -> list[str]:
        return [
            str(find_binary("envoy")),
            "-c",
            str(self.bootstrap_path),
            "--service-node",
            self.node_id,
            "--service-cluster",
            self.fleet,
            # A second Envoy with the default base id dies with
            # "unable to bind domain socket with base_id=0".
            "--use-dynamic-base-id",
            "--admin-address-path",
            str(self._admin_address_path),
            "--log-level",
            self.log_level,
            *self.extra_args,
        ]

    def _read_admin_address(self) -> bool:
        try:
            address = self._admin_address_path.read_text().strip()
        except OSError:
            return False
        if not address or address.endswith(":0"):
            return False
        self._admin_url = f"http://{address}"
        return True

    def _admin_answers(self) -> bool:
        if self._admin_url is None and not self._read_admin_address():
            return False
        return http_get(f"{self.admin_url}/ready") is not None

    def start(self, timeout: float = 30.0) -> Self:
        """Start Envoy and wait until its admin interface answers (see `wait_ready`)."""
        if self.running():
            return self
        self.render()
        self._admin_address_path.unlink(missing_ok=True)
        if self.admin_port is None:
            self._admin_url = None
        self._process = ManagedProcess(self._argv(), self.log_path)
        self._process.spawn()
        self._process.wait_for(self._admin_answers, timeout, "the admin interface answers")
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until `GET /ready` is 200 LIVE: Envoy got its initial config from xDS."""

        def live() -> bool:
            response = http_get(f"{self.admin_url}/ready")
            return response is not None and response.status_code == 200

        process = self._require_started()
        deadline = time.monotonic() + timeout
        while not live():
            if not process.running():
                raise LauncherError(
                    f"envoy exited with status {process.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                state = http_get(f"{self.admin_url}/ready")
                said = state.text.strip() if state is not None else "no answer"
                # Unlike start(), leave Envoy running: the caller may want to inspect it.
                raise LauncherError(
                    f"envoy not LIVE after {timeout:.0f}s (/ready: {said}); is the control "
                    f"plane at {self.xds_address}:{self.xds_port} serving fleet {self.fleet!r}? "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL)

    def _require_started(self) -> ManagedProcess:
        if self._process is None:
            raise LauncherError("envoy was not started")
        return self._process

    def _admin_get(self, path: str) -> httpx.Response:
        try:
            response = httpx.get(f"{self.admin_url}{path}", timeout=5.0, verify=default_verify())
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise LauncherError(f"envoy admin {path} failed: {exc}") from exc
        return response

    def stats(self, matching: str | None = None) -> dict[str, int | str]:
        """Counters and gauges by name (`GET /stats?format=json`); histograms are left out.

        `matching`, a regular expression (RE2, searched in the name), keeps only the stats it
        matches: Envoy then renders and sends those instead of its thousands, which matters
        to a caller that polls one counter.
        """
        path = "/stats?format=json"
        if matching is not None:
            path += "&filter=" + urllib.parse.quote(matching, safe="")
        data = self._admin_get(path).json()
        result: dict[str, int | str] = {}
        for entry in data.get("stats", []):
            if "name" in entry and "value" in entry:
                value = entry["value"]
                result[entry["name"]] = value if isinstance(value, int | str) else str(value)
        return result

    def config_dump(self, *, include_eds: bool = False) -> dict[str, Any]:
        """`GET /config_dump` as JSON; `include_eds` adds the endpoint assignments."""
        path = "/config_dump?include_eds" if include_eds else "/config_dump"
        dump: dict[str, Any] = self._admin_get(path).json()
        return dump

    def clusters(self) -> str:
        """`GET /clusters`: per-host membership, health and weights, as text."""
        return self._admin_get("/clusters").text
