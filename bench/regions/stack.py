"""The regions benchmark's rig: etcd, ``kvpilot serve``, per region a process of simulated
replicas (which add the inter-region round trip), ``kvpilot agent`` processes that register
them with their region and capacity kind (the spot ones watching a preemption notice file),
and one Envoy per region, each its own fleet."""

from __future__ import annotations

import contextlib
import functools
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from api.client import KvpilotClient
from bench.regions.config import RegionsConfig
from controlplane.local import (
    EmbeddedEnvoy,
    EmbeddedEtcd,
    KvpilotProcess,
    ManagedProcess,
    free_port,
    repo_root,
    wait_until,
)
from controlplane.local.replicas import BackendProcess
from policies.models import API_VERSION

MODEL = "sim-model"
POOL = "llm"


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class RegionsStack:
    config: RegionsConfig
    kvpilot: KvpilotProcess
    token: str
    envoys: dict[str, EmbeddedEnvoy]
    backends: dict[str, BackendProcess]
    ports: dict[str, int]
    """Each region's Envoy listener port."""
    notice_files: dict[str, Path]
    agents: list[ManagedProcess] = field(default_factory=list)
    pools: tuple[str, ...] = (POOL,)
    """The pools the agents register the replicas in (``replica_pool``)."""

    def url(self, region: str) -> str:
        return f"http://127.0.0.1:{self.ports[region]}/v1/chat/completions"

    def client(self) -> KvpilotClient:
        return KvpilotClient(self.kvpilot.api_url, token=self.token)

    def spot_ids(self) -> list[str]:
        """The spot replicas: the last ``spot[i]`` replicas of region i."""
        config = self.config
        return [
            f"{region}-{index}"
            for region, spot in zip(config.regions, config.spot, strict=True)
            for index in range(config.replicas - spot, config.replicas)
        ]


def _replica_pool(config: RegionsConfig, name: str) -> dict[str, Any]:
    """A Pool of the model with the benchmark's health checks and telemetry (its replicas
    registered by the agents; the ``gate`` policy's external pools drop the telemetry and
    list their replicas by name)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "Pool",
        "metadata": {"name": name},
        "spec": {
            "models": [MODEL],
            "telemetry": {"format": "vllm", "interval": config.agent_interval, "maxAge": "3s"},
            "healthCheck": {"interval": "1s", "timeout": "500ms", "unhealthyThreshold": 2},
        },
    }


def replica_pool(region: str, *, gate: bool) -> str:
    """The pool `region`'s agents register its replicas in: one for all, or with ``gate``
    one per region."""
    return f"{POOL}-{region}" if gate else POOL


def gate_objects(
    config: RegionsConfig, ports: dict[str, int], replicas: dict[str, list[int]]
) -> list[dict[str, Any]]:
    """The ``gate`` policy (``config.EXTRA_POLICIES``): each region's replicas (`replicas`:
    their ports) in a pool of their own, registered by the agents, behind a gate at 90% of
    their batch slots; the other region's replicas named by DNS (``localhost``), an external
    pool with a cluster of its own, which takes what the gate turns away. No locality and
    no share: a request crosses only when its region's slots are taken."""
    out: list[dict[str, Any]] = []
    for region in config.regions:
        out.append(_replica_pool(config, replica_pool(region, gate=True)))
        far = _replica_pool(config, f"far-{region}")
        del far["spec"]["telemetry"]
        far["spec"]["endpoints"] = [{"address": "localhost", "port": p} for p in replicas[region]]
        out.append(far)
    a, b = config.regions
    for region, other in ((a, b), (b, a)):
        out.append(
            {"apiVersion": API_VERSION, "kind": "Fleet", "metadata": {"name": region}, "spec": {}}
        )
        out.append(
            _policy(
                region,
                ports[region],
                tiers=[[replica_pool(region, gate=True)]],
                overflow={
                    "pools": [f"far-{other}"],
                    "signal": "fill",
                    "maxShare": 0,
                    "maxInFlight": "auto",
                    # Every slot: a request crosses only when it finds them all taken.
                    "gateShare": 1.0,
                },
            )
        )
    return out


def _policy(region: str, port: int, **route: Any) -> dict[str, Any]:
    """Region's fleet's RoutingPolicy on its own port: one route, least request."""
    return {
        "apiVersion": API_VERSION,
        "kind": "RoutingPolicy",
        "metadata": {"name": f"chat-{region}"},
        "spec": {
            "fleets": [region],
            "listener": {"port": port, "address": "127.0.0.1"},
            "routes": [
                {
                    "name": "all",
                    "balancing": "least_request",
                    "timeouts": {"request": "120s"},
                    **route,
                }
            ],
        },
    }


def objects(
    config: RegionsConfig, ports: dict[str, int], *, aware: bool, signal: str = "arrivals"
) -> list[dict[str, Any]]:
    """The Pool (endpoints come from the agents), per region a Fleet (with its locality when
    `aware`) and a RoutingPolicy for that fleet on its own port."""
    out: list[dict[str, Any]] = [_replica_pool(config, POOL)]
    for region in config.regions:
        spec: dict[str, Any] = (
            {"locality": {"region": region}, "spillSignal": signal} if aware else {}
        )
        out.append(
            {"apiVersion": API_VERSION, "kind": "Fleet", "metadata": {"name": region}, "spec": spec}
        )
        out.append(_policy(region, ports[region], tiers=[[POOL]]))
    return out


def _agent(
    config: RegionsConfig,
    state_dir: Path,
    etcd: str,
    region: str,
    capacity: str,
    urls: list[str],
    notice: Path | None,
    pool: str,
) -> ManagedProcess:
    argv = [
        *(sys.executable, "-m", "commands.cli", "agent", "--etcd-endpoints", etcd),
        *("--pool", pool, "--register", "--region", region, "--capacity", capacity),
        *(
            "--interval",
            f"{config.agent_interval:g}",
            "--refresh",
            f"{3 * config.agent_interval:g}",
        ),
        *("--max-running", str(config.sim.max_batch), "--ttl", "5", "--unregister-after", "2"),
        *("--log-level", "warning"),
    ]
    if notice is not None:
        argv += ["--preemption-notice", f"file:{notice}", "--notice-interval", "0.2"]
    for url in urls:
        argv += ["--backend", url]
    agent = ManagedProcess(argv, state_dir / f"agent-{region}-{capacity}.log", cwd=repo_root())
    agent.spawn()
    return agent


@contextlib.contextmanager
def start_regions(
    config: RegionsConfig,
    state_dir: Path,
    *,
    aware: bool,
    signal: str = "arrivals",
    gate: bool = False,
) -> Iterator[RegionsStack]:
    """The rig for one policy, stopped on exit: with `gate`, the ``gate`` policy's objects
    (``gate_objects``), else those of ``objects``."""
    token = secrets.token_urlsafe(24)
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(
            EmbeddedEtcd(state_dir / "etcd", extra_args=["--unsafe-no-fsync"]).start()
        )
        kvpilot = stack.enter_context(
            KvpilotProcess(
                state_dir / "kvpilot",
                etcd_endpoints=[etcd.endpoint],
                env={"KVPILOT_ADMIN_TOKEN": token},
            ).start()
        )
        backends = {
            region: stack.enter_context(
                BackendProcess(
                    config.replicas,
                    id_prefix=region,
                    model=MODEL,
                    state_dir=state_dir / f"backends-{region}",
                    simulator=config.sim,
                    ports=[free_port() for _ in range(config.replicas)],
                    region=region,
                    remote_delay=config.rtt,
                ).start()
            )
            for region in config.regions
        }
        ports = {region: free_port() for region in config.regions}
        notices = {region: state_dir / f"notice-{region}" for region in config.regions}
        for path in notices.values():
            path.unlink(missing_ok=True)
        pools = tuple(sorted({replica_pool(r, gate=gate) for r in config.regions}))
        rig = RegionsStack(config, kvpilot, token, {}, backends, ports, notices, pools=pools)
        client = rig.client()
        bodies = (
            gate_objects(
                config, ports, {r: [x.port for x in backends[r].replicas] for r in backends}
            )
            if gate
            else objects(config, ports, aware=aware, signal=signal)
        )
        for body in bodies:
            client.put(body)
        for region, spot in zip(config.regions, config.spot, strict=True):
            replicas = backends[region].replicas
            kinds: list[tuple[str, list[Any], Path | None]] = [
                ("on-demand", replicas[: len(replicas) - spot], None),
                ("spot", replicas[len(replicas) - spot :], notices[region]),
            ]
            for capacity, members, notice in kinds:
                if members:
                    agent = _agent(
                        config,
                        state_dir,
                        etcd.endpoint,
                        region,
                        capacity,
                        [m.url for m in members],
                        notice,
                        replica_pool(region, gate=gate),
                    )
                    rig.agents.append(agent)
                    stack.callback(agent.stop)
        for region in config.regions:
            rig.envoys[region] = stack.enter_context(
                EmbeddedEnvoy(
                    state_dir / f"envoy-{region}",
                    xds_address="127.0.0.1",
                    xds_port=kvpilot.xds_port,
                    node_id=f"envoy-{region}",
                    fleet=region,
                ).start()
            )
        total = config.replicas * len(config.regions)

        def registered() -> int:
            return sum(len(client.endpoints(pool)) for pool in pools)

        wait_until(lambda: registered() == total, 60, f"{total} registered replicas")
        for region in config.regions:
            wait_until(functools.partial(_all_answer, rig.url(region)), 60, f"{region} answers")
        yield rig


def _all_answer(url: str) -> bool:
    try:
        for _ in range(8):
            response = httpx.post(
                url,
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                timeout=10,
            )
            if response.status_code != 200:
                return False
    except httpx.HTTPError:
        return False
    return True


__all__ = [
    "MODEL",
    "POOL",
    "RegionsStack",
    "gate_objects",
    "objects",
    "replica_pool",
    "say",
    "start_regions",
]
