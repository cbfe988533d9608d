"""A single-member etcd on free loopback ports, for `kvpilot serve`'s embedded default,
the demo and the tests."""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from controlplane.local.launcher import Launcher, http_get
from controlplane.local.process import ManagedProcess, find_binary, free_port
from xdsserver.identity import TlsFiles


class EmbeddedEtcd(Launcher):
    """A single-member etcd for local use and tests, with its data and log under `state_dir`.

    Ports are fixed at construction (picked free when not given) and kept across
    `stop()`/`kill()` and `start()`, so clients can reconnect to a restarted etcd. Only on the
    first start, a port picked here that another process took before etcd bound it is picked
    again; a port the caller gave is never replaced.
    """

    # `listen tcp 127.0.0.1:2380: bind: address already in use`
    _port_taken = (re.compile(r"listen tcp \S+:(\d+): bind: address already in use"),)

    def __init__(
        self,
        state_dir: Path,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "kvpilot",
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.tls = tls
        """Serve clients over TLS with this certificate and require client certificates signed
        by `tls.client_ca` (etcd's --client-cert-auth). The launcher's own health check
        presents `tls.cert`, so issue it for both server and client use."""
        self.host = host
        self.name = name
        self.extra_args = list(extra_args)
        self.client_port = self._port("client_port", client_port)
        self.peer_port = self._port("peer_port", peer_port)
        self.data_dir = self.state_dir / "etcd-data"
        self.log_path = self.state_dir / "etcd.log"
        """etcd's stdout and stderr."""
        self._process = None

    @property
    def endpoint(self) -> str:
        """`host:port` of the client API, as gRPC clients (aetcd) want it."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        """`http://host:port` (`https://` with TLS) of the client API."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def _argv(self) -> list[str]:
        return [
            str(find_binary("etcd")),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            f"{self.name}={self.peer_url}",
            "--initial-cluster-state",
            "new",
            *self._tls_args(),
            *self.extra_args,
        ]

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return [
            "--cert-file",
            str(self.tls.cert),
            "--key-file",
            str(self.tls.key),
            "--trusted-ca-file",
            str(self.tls.client_ca),
            "--client-cert-auth",
        ]

    def _healthy(self) -> bool:
        response = http_get(f"{self.client_url}/health", self.tls)
        if response is None or response.status_code != 200:
            return False
        try:
            return bool(response.json().get("health") == "true")
        except ValueError:
            return False

    def start(self, timeout: float = 30.0) -> Self:
        """Start etcd and wait until `GET /health` says `{"health": "true"}`."""
        if self.running():
            return self
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._start_child(
            lambda: ManagedProcess(self._argv(), self.log_path),
            self._healthy,
            timeout,
            "etcd reports healthy",
        )
        return self


class EmbeddedEtcdCluster:
    """Several etcd members on one host, for trying what production's cluster does when
    members die: `members[i].kill()` and `.start()` again (same data, same ports).

    Members start together: each reports healthy only once the cluster has a leader.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        size: int = 3,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
    ) -> None:
        names = [f"member-{i}" for i in range(size)]
        ports = [(free_port(host), free_port(host)) for _ in names]
        initial = ",".join(
            f"{name}=http://{host}:{peer}" for name, (_, peer) in zip(names, ports, strict=True)
        )
        token = f"kvpilot-{secrets.token_hex(4)}"
        self.members = [
            EmbeddedEtcd(
                Path(state_dir) / name,
                host=host,
                client_port=client,
                peer_port=peer,
                name=name,
                # etcd takes the last of a repeated flag: these replace the single-member ones.
                extra_args=[
                    "--initial-cluster",
                    initial,
                    "--initial-cluster-token",
                    token,
                    *extra_args,
                ],
            )
            for name, (client, peer) in zip(names, ports, strict=True)
        ]

    @property
    def endpoints(self) -> list[str]:
        """Every member's `host:port`, as `EtcdClient` and `kvpilot serve --etcd-endpoints` take them."""
        return [member.endpoint for member in self.members]

    def start(self, timeout: float = 60.0) -> Self:
        """Start every member that is not running, together, and wait until all are healthy.

        Spawned from this thread: a child's parent-death signal fires when the thread that
        forked it ends, so members must not be started from short-lived threads.
        """
        starting = [member for member in self.members if not member.running()]
        for member in starting:
            member.state_dir.mkdir(parents=True, exist_ok=True)
            member._process = ManagedProcess(member._argv(), member.log_path)
            member._process.spawn()
            member._started_once = True
        for member in starting:
            assert member._process is not None
            member._process.wait_for(member._healthy, timeout, "etcd reports healthy")
        return self

    def stop(self) -> None:
        for member in self.members:
            member.stop()
