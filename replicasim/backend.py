"""Simulated OpenAI-compatible model replicas, several per process, for tests and the demo.

Each replica (`replicasim.replica`: its endpoints, switches and counters) listens on its own port
and says who it is (`x-backend-id` header and a `backend` field), so tests behind Envoy can
assert which replica answered. With `--simulate` each runs a `replicasim.simulator.Engine` instead
of answering at once.

Run it:  python -m replicasim.backend --replicas 3 --host 127.0.0.1 --ports 0 --id-prefix be
         [--simulate [--sim-config '{"time_scale": 2.0, "orca": true}']]
It prints one JSON line `{"replicas": [{"id": "be-0", "port": 12345}, ...]}` once every replica
listens, then serves until SIGTERM or SIGINT. `BackendProcess` does that from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx

from controlplane.asgi import ServerGroup, UvicornServer, read_announcement
from controlplane.launchers import Launcher, LauncherError, ManagedProcess
from replicasim.replica import DEFAULT_MODEL, Replica, build_app
from replicasim.simulator import Engine, SimConfig

# --------------------------------------------------------------------------- serving


async def serve(replicas: Sequence[Replica], host: str, ports: Sequence[int]) -> None:
    """Serve each replica on its port until SIGTERM/SIGINT; announce ports on stdout once up."""
    group = ServerGroup([build_app(replica) for replica in replicas], host, ports)
    engines = [
        asyncio.create_task(replica.engine.run())
        for replica in replicas
        if replica.engine is not None
    ]

    def dying(server: UvicornServer) -> Callable[[], None]:
        def stop() -> None:
            # A dead replica drops its connections instead of draining them.
            server.config.timeout_graceful_shutdown = 0
            server.should_exit = True
            server.force_exit = True

        return stop

    for replica, server in zip(replicas, group.servers, strict=True):
        replica.on_death = dying(server)
    if await group.start():
        group.announce([replica.id for replica in replicas])
    # One replica stopping (a signal, or a crash) stops them all; a replica told to die
    # (`/admin/die`) stops alone.
    pending = set(group.tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(not replicas[group.tasks.index(task)].dead for task in done):
            break
    group.request_exit()
    await group.wait()
    for task in engines:
        task.cancel()
    await asyncio.gather(*engines, return_exceptions=True)


def parse_ports(text: str, replicas: int) -> list[int]:
    ports = [int(p) for p in text.split(",") if p.strip()]
    if ports == [0]:
        return [0] * replicas
    if len(ports) != replicas:
        raise ValueError(f"--ports lists {len(ports)} ports for {replicas} replicas")
    return ports


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replicasim.backend", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--ports", default="0", help="0 for free ports, or a comma list, one per replica"
    )
    parser.add_argument("--id-prefix", default="be")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--simulate", action="store_true", help="run a simulated vLLM engine per replica"
    )
    parser.add_argument(
        "--sim-config", default="{}", help="SimConfig fields as JSON, with --simulate"
    )
    args = parser.parse_args(argv)
    try:
        ports = parse_ports(args.ports, args.replicas)
    except ValueError as exc:
        parser.error(str(exc))
    sim_config = SimConfig.from_json(args.sim_config) if args.simulate else None

    async def run() -> None:
        # Engines hold asyncio events: create them inside the running loop.
        replicas = [
            Replica(
                id=f"{args.id_prefix}-{i}",
                model=args.model,
                engine=Engine(sim_config, args.model) if sim_config else None,
            )
            for i in range(args.replicas)
        ]
        await serve(replicas, args.host, ports)

    asyncio.run(run())
    return 0


# --------------------------------------------------------------------------- Python API


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
    """`python -m replicasim.backend` as a child process, for tests and the demo.

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
        simulator: SimConfig | None = None,
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
            "replicasim.backend",
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
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._stdout_path.unlink(missing_ok=True)
        self._process.spawn()
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
            httpx.post(url, json=body, timeout=5.0).raise_for_status()
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


if __name__ == "__main__":
    sys.exit(main())
