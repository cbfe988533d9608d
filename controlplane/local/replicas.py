"""Simulated model replicas (`python -m replicasim`) as a child process, for the demo, the
benchmarks and the tests.

A launcher like those of etcd, Envoy and kvpilot. It starts the replicas by module name and
passes the simulator's settings as JSON, so this package does not import `replicasim` (which
stands beside the layers and imports none of them).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self

import httpx

from controlplane.asgi import read_announcement
from controlplane.local.launcher import Launcher, default_verify
from controlplane.local.process import LauncherError, ManagedProcess

DEFAULT_MODEL = "sim-model"
"""The model the replicas serve unless told otherwise (`replicasim.replica.DEFAULT_MODEL`)."""


class SimulatorSettings(Protocol):
    """What the launcher needs of the engine settings (`replicasim.simulator.SimConfig`)."""

    def to_json(self) -> str: ...


@dataclass(frozen=True)
class ReplicaInfo:
    """Where one replica of a `BackendProcess` listens."""

    id: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class BackendProcess(Launcher):
    """`python -m replicasim` as a child process, for tests, the benchmarks and the demo.

    A launcher like those of etcd and Envoy: own process group, killed with its parent,
    stopped at interpreter exit; `kill()` SIGKILLs every replica at once, as a crash would.
    """

    _process: ManagedProcess

    def __init__(
        self,
        replicas: int = 2,
        *,
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        id_prefix: str = "be",
        model: str = DEFAULT_MODEL,
        state_dir: Path | None = None,
        simulator: SimulatorSettings | None = None,
        lora: dict[str, Any] | None = None,
        region: str = "",
        remote_delay: float = 0.0,
    ) -> None:
        self.host = host
        self.id_prefix = id_prefix
        self.state_dir = (
            Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="kvpilot-backend-"))
        )
        self.log_path = self.state_dir / f"backend-{id_prefix}.log"
        self._stdout_path = self.state_dir / f"backend-{id_prefix}.out"
        port_arg = ",".join(str(p) for p in ports) if ports else "0"
        argv = [
            sys.executable,
            "-m",
            "replicasim",
            "--replicas",
            str(replicas),
            "--host",
            host,
            "--ports",
            port_arg,
            "--id-prefix",
            id_prefix,
            "--model",
            model,
        ]
        if simulator is not None:
            argv += ["--simulate", "--sim-config", simulator.to_json()]
        if lora is not None:
            # `replicasim.lora.LoraSlots.from_config` checks it.
            argv += ["--lora", json.dumps(lora)]
        if region:
            # The replicas add a simulated inter-region round trip to requests from elsewhere.
            argv += ["--region", region, "--remote-delay", f"{remote_delay:g}"]
        self.simulator = simulator
        """The engine settings when the replicas simulate vLLM, else None."""
        self._process = ManagedProcess(argv, self.log_path, stdout_path=self._stdout_path)
        self.replicas: list[ReplicaInfo] = []
        """The replicas, known once `start()` returns."""

    def _read_announcement(self) -> bool:
        ports = read_announcement(self._stdout_path)
        if ports is not None:
            self.replicas = [ReplicaInfo(id_, self.host, port) for id_, port in ports.items()]
        return ports is not None

    def start(self, timeout: float = 30.0) -> Self:
        """Start the replicas and wait until all of them listen."""
        if self._process.running():
            return self
        self.spawn()
        return self.wait_started(timeout)

    def spawn(self) -> None:
        """Start the replicas without waiting: the caller starts other things meanwhile, then
        calls `wait_started`. (From the thread that stops them: the child dies with the thread
        that spawned it.)"""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._stdout_path.unlink(missing_ok=True)
        self._process.spawn()

    def wait_started(self, timeout: float = 30.0) -> Self:
        """Wait until every replica spawned by `spawn` listens."""
        self._process.wait_for(self._read_announcement, timeout, "the replicas listen")
        return self

    def replica(self, replica_id: str) -> ReplicaInfo:
        """The replica with this id."""
        for info in self.replicas:
            if info.id == replica_id:
                return info
        raise KeyError(f"no replica {replica_id!r}; have {[r.id for r in self.replicas]}")

    def _admin(self, replica_id: str, path: str, body: dict[str, Any]) -> None:
        url = f"{self.replica(replica_id).url}{path}"
        try:
            httpx.post(url, json=body, timeout=5.0, verify=default_verify()).raise_for_status()
        except httpx.HTTPError as exc:
            raise LauncherError(f"backend admin {url} failed: {exc}") from exc

    def fail(self, replica_id: str, status: int) -> None:
        """Make the replica answer every inference request with `status`; 0 recovers."""
        self._admin(replica_id, "/admin/fail", {"status": status})

    def set_healthy(self, replica_id: str, healthy: bool) -> None:
        """Make the replica's `/health` answer 200 (True) or 503 (False)."""
        self._admin(replica_id, "/admin/health", {"healthy": healthy})

    def slow(self, replica_id: str, factor: float) -> None:
        """Make a simulated replica's engine steps `factor` times slower; 1 recovers."""
        self._admin(replica_id, "/admin/slow", {"factor": factor})

    def die(self, replica_id: str) -> None:
        """Make one simulated replica abort its requests and stop listening."""
        self._admin(replica_id, "/admin/die", {})

    def adapters(
        self, replica_id: str, *, load: Sequence[str] = (), unload: Sequence[str] = ()
    ) -> None:
        """Load and unload LoRA adapters on one replica at once (it must serve adapters)."""
        self._admin(replica_id, "/admin/adapters", {"load": list(load), "unload": list(unload)})

    def reset(
        self,
        replica_id: str | None = None,
        *,
        keep_cache: bool = False,
        kv_blocks: int | None = None,
    ) -> None:
        """Drop the prefix cache (unless `keep_cache`) and zero the counters of one simulated
        replica, or all; `kv_blocks` resizes their (idle) KV cache."""
        body: dict[str, Any] = {"cache": "keep"} if keep_cache else {}
        if kv_blocks is not None:
            body["kv_blocks"] = kv_blocks
        for info in [self.replica(replica_id)] if replica_id else self.replicas:
            self._admin(info.id, "/admin/reset", body)
