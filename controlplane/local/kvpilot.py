"""`kvpilot serve` as a child process, for the demo, the benchmarks and end-to-end tests."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from controlplane.etcd import EtcdSecurity
from controlplane.local.launcher import Launcher, http_get
from controlplane.local.process import ManagedProcess, repo_root
from xdsserver.identity import TlsFiles


class KvpilotProcess(Launcher):
    """`kvpilot serve` as a child process, against a given etcd, on free ports.

    Without `etcd_endpoints` it runs on serve's default, an embedded etcd under `state_dir`.

    What production runs, started the way the demo and end-to-end tests need it: ready means
    `GET /readyz` answers 200 (etcd reachable and the first snapshot built). Ports not given
    are picked free, and on the first start picked again if another process takes one first.
    """

    _port_taken = (
        # gRPC, for the ADS port: `Failed to bind to address 127.0.0.1:18000; set ...`
        re.compile(r"Failed to bind to address \S+:(\d+);"),
        # uvicorn, for the API port:
        # `... bind on address ('127.0.0.1', 8080): address already in use`
        re.compile(r"bind on address \('[^']*', (\d+)\): address already in use"),
    )

    def __init__(
        self,
        state_dir: Path,
        *,
        etcd_endpoints: Sequence[str] = (),
        prefix: str = "/kvpilot",
        host: str = "127.0.0.1",
        xds_port: int | None = None,
        api_port: int | None = None,
        env: Mapping[str, str] | None = None,
        insecure_no_auth: bool = False,
        extra_args: Sequence[str] = (),
        xds_tls: TlsFiles | None = None,
        xds_identity_fleets: Sequence[str] = (),
        etcd_security: EtcdSecurity | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.cwd = cwd or repo_root()
        """Where the child runs: `python -m` imports kvpilot from there (another checkout of
        it, for a benchmark against an older commit)."""
        self.etcd_security = etcd_security
        """etcd TLS files and user; the password goes to the child in KVPILOT_ETCD_PASSWORD."""
        self.xds_tls = xds_tls
        """ADS over mutual TLS with these files; None serves plaintext ADS
        (--xds-insecure-plaintext), which most end-to-end tests use."""
        self.xds_identity_fleets = list(xds_identity_fleets)
        self.etcd_endpoints = list(etcd_endpoints)
        self.prefix = prefix
        self.host = host
        self.xds_port = self._port("xds_port", xds_port)
        self.api_port = self._port("api_port", api_port)
        self.env = dict(env or {})
        self.insecure_no_auth = insecure_no_auth
        self.extra_args = list(extra_args)
        self.log_path = self.state_dir / "kvpilot.log"
        self._process: ManagedProcess | None = None

    @property
    def api_url(self) -> str:
        """Base URL of the REST API."""
        return f"http://{self.host}:{self.api_port}"

    def _argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "commands.cli",
            "serve",
            "--etcd-endpoints",
            ",".join(self.etcd_endpoints),  # empty: an embedded etcd
            "--etcd-prefix",
            self.prefix,
            "--xds-address",
            f"{self.host}:{self.xds_port}",
            "--api-address",
            f"{self.host}:{self.api_port}",
            "--state-dir",
            str(self.state_dir),
            *self.extra_args,
        ]
        if self.insecure_no_auth:
            argv.append("--insecure-no-auth")
        security = self.etcd_security
        if security is not None:
            for flag, value in (
                ("--etcd-cacert", security.ca),
                ("--etcd-cert", security.cert),
                ("--etcd-key", security.key),
                ("--etcd-user", security.user),
            ):
                if value is not None:
                    argv += [flag, str(value)]
        if self.xds_tls is None:
            argv.append("--xds-insecure-plaintext")
        else:
            argv += [
                "--xds-cert",
                str(self.xds_tls.cert),
                "--xds-key",
                str(self.xds_tls.key),
                "--xds-client-ca",
                str(self.xds_tls.client_ca),
            ]
            for binding in self.xds_identity_fleets:
                argv += ["--xds-identity-fleet", binding]
        return argv

    def _ready(self) -> bool:
        response = http_get(f"{self.api_url}/readyz")
        return response is not None and response.status_code == 200

    def start(self, timeout: float = 30.0) -> Self:
        """Start `kvpilot serve` and wait until it is ready."""
        if self.running():
            return self
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        if self.etcd_security is not None and self.etcd_security.password is not None:
            env["KVPILOT_ETCD_PASSWORD"] = self.etcd_security.password
        self._start_child(
            lambda: ManagedProcess(self._argv(), self.log_path, env=env, cwd=self.cwd),
            self._ready,
            timeout,
            "GET /readyz answers 200",
        )
        return self
