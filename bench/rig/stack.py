"""One Envoy, kvpilot and a fleet of simulated replicas: the rig the routing and service-class
benchmarks replay through, and the checks they wait on.

`start_stack` starts an embedded etcd, ``kvpilot serve``, one Envoy fed by it over ADS, a
process of simulated vLLM replicas and one ``kvpilot agent`` that writes their telemetry to
etcd. The rest reads the rig: whether Envoy serves a policy (its clusters' load balancers in
``/config_dump``, every replica healthy), whether the replicas are idle, kvpilot's telemetry
metrics; and prepares a replay (`ready_for_replay`: empty caches, shared system prompts put
back).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from api.client import KvpilotClient
from bench.rig.loadgen import parse_metrics
from controlplane.local import (
    EmbeddedEnvoy,
    KvpilotProcess,
    ManagedProcess,
    free_port,
    local_stack,
    repo_root,
    wait_until,
)
from controlplane.local.replicas import BackendProcess
from policies.models import RoutingPolicy
from policies.names import QUEUE_INFIX, cluster_name
from replicasim.simulator import SimConfig
from xdsserver.translate.clusters import twins

MODEL = "sim-model"
POOL = "bench"
POLICY_NAME = "bench"


def say(text: str = "") -> None:
    """A progress line, shown at once (a benchmark's output is often piped to a log)."""
    print(text, flush=True)


def chat_url(port: int) -> str:
    """The chat completions URL of an Envoy listener on `port`."""
    return f"http://127.0.0.1:{port}/v1/chat/completions"


@dataclass
class Stack:
    kvpilot: KvpilotProcess
    envoy: EmbeddedEnvoy
    backends: BackendProcess
    agent: ManagedProcess
    token: str
    listener_port: int
    etcd_endpoint: str
    state_dir: Path

    @property
    def url(self) -> str:
        return chat_url(self.listener_port)

    def put(self, body: dict[str, Any]) -> None:
        """Create or replace an object through the REST API."""
        KvpilotClient(self.kvpilot.api_url, token=self.token).put(body)


class StackSettings(Protocol):
    """What the rig takes from a benchmark's settings (`bench.routing.sequential.RoutingConfig` has it)."""

    @property
    def replicas(self) -> int:
        """How many simulated replicas the rig starts."""

    @property
    def sim(self) -> SimConfig:
        """The simulated replicas' engine."""

    @property
    def agent_interval(self) -> float:
        """Simulated seconds between the telemetry agent's scrapes."""


@contextlib.contextmanager
def start_stack(state_dir: Path, config: StackSettings) -> Iterator[Stack]:
    """The rig, with `config.replicas` simulated replicas."""
    sim = config.sim
    with contextlib.ExitStack() as stack:
        # The benchmark measures routing, not disk: etcd skips fsync.
        local = stack.enter_context(
            local_stack(state_dir, node_id="bench-envoy", etcd_args=["--unsafe-no-fsync"])
        )
        backends = stack.enter_context(
            BackendProcess(
                config.replicas,
                id_prefix="replica",
                model=MODEL,
                state_dir=state_dir / "backends",
                simulator=sim,
            ).start()
        )
        agent = start_agent(
            state_dir / "agent",
            local.etcd.endpoint,
            [replica.url for replica in backends.replicas],
            pool=POOL,
            interval=config.agent_interval * sim.time_scale,
            max_running=sim.max_batch,
        )
        stack.callback(agent.stop)
        yield Stack(
            local.kvpilot,
            local.envoy,
            backends,
            agent,
            local.admin_token,
            free_port(),
            local.etcd.endpoint,
            state_dir,
        )


def start_agent(
    state_dir: Path,
    etcd_endpoint: str,
    urls: list[str],
    *,
    pool: str,
    interval: float,
    max_running: int,
) -> ManagedProcess:
    """One `kvpilot agent` for the replicas at `urls`, writing their telemetry to etcd every
    `interval` wall-clock seconds under `pool` (no registration: the pool lists its endpoints
    statically)."""
    argv = [
        sys.executable,
        "-m",
        "commands.cli",
        "agent",
        "--etcd-endpoints",
        etcd_endpoint,
        "--pool",
        pool,
        "--interval",
        f"{interval:g}",
        "--refresh",
        f"{3 * interval:g}",
        "--max-running",
        str(max_running),
        "--log-level",
        "warning",
    ]
    for url in urls:
        argv += ["--backend", url]
    agent = ManagedProcess(argv, state_dir / "agent.log", cwd=repo_root())
    agent.spawn()
    return agent


# --------------------------------------------------------------------------- configuration


def put_pool(
    stack: Stack,
    name: str = POOL,
    replicas: Sequence[int] | None = None,
    *,
    price: Mapping[str, str] | None = None,
) -> None:
    """The pool `name` of the stack's replicas at the indices `replicas` (default: all of
    them), with the Pool `price` when given, and the default fleet without access logs."""
    every = stack.backends.replicas
    indices = range(len(every)) if replicas is None else replicas
    stack.put(
        {
            "apiVersion": "kvpilot.io/v1",
            "kind": "Pool",
            "metadata": {"name": name},
            "spec": {
                **({"price": dict(price)} if price is not None else {}),
                "models": [MODEL],
                # Named, so the ring places replica i at the same points in every run.
                "endpoints": [
                    {"address": every[i].host, "port": every[i].port, "name": f"replica-{i}"}
                    for i in indices
                ],
                "healthCheck": {"path": "/health", "interval": "1s", "timeout": "500ms"},
                # Read by routes with balancing 'telemetry' only; the others keep static weights.
                "telemetry": {"format": "vllm", "maxAge": "5s"},
            },
        }
    )
    stack.put(
        {
            "apiVersion": "kvpilot.io/v1",
            "kind": "Fleet",
            "metadata": {"name": "default"},
            "spec": {"accessLog": False},
        }
    )


def policy_body(
    listener_port: int, route: Mapping[str, Any], before: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The benchmark's RoutingPolicy: one route to the pool with `route`'s balancing fields,
    after the routes `before` (whole routes, matched first)."""
    chat = {"name": "chat", "match": {"pathPrefix": "/v1/"}, "tiers": [[POOL]], **route}
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "listener": {"address": "127.0.0.1", "port": listener_port},
            "routes": [*before, chat],
        },
    }


# --------------------------------------------------------------------------- what Envoy serves

Signature = tuple[str, int]
"""(load balancer, bounded-load factor) of a cluster."""


def _lb_signature(cluster: dict[str, Any]) -> Signature:
    """(load balancer, bounded-load factor) of a cluster from Envoy's /config_dump."""
    custom = cluster.get("load_balancing_policy", {}).get("policies", [])
    if custom:
        lb = custom[0].get("typed_extension_config", {}).get("name", "custom").rsplit(".", 1)[-1]
    else:
        lb = cluster.get("lb_policy", "ROUND_ROBIN")
    hashing = cluster.get("common_lb_config", {}).get("consistent_hashing_lb_config", {})
    return lb, int(hashing.get("hash_balance_factor", 0))


def _clusters_in_envoy(envoy: EmbeddedEnvoy) -> dict[str, Signature]:
    """{cluster name: load-balancer signature} of Envoy's active dynamic clusters."""
    out: dict[str, Signature] = {}
    for config in envoy.config_dump()["configs"]:
        for entry in config.get("dynamic_active_clusters", []):
            cluster = entry.get("cluster", {})
            out[cluster.get("name", "")] = _lb_signature(cluster)
    return out


def expected_clusters(
    body: Mapping[str, Any], pool_sizes: Mapping[str, int]
) -> dict[str, tuple[Signature, int]]:
    """{cluster name: (load-balancer signature, hosts)} that Envoy shows once the policy
    `body` is applied (each route's defaults as kvpilot fills them in), with the pools'
    endpoint counts `pool_sizes`. A queued service class's cluster is not listed: it is its
    route's cluster with other circuit breakers."""
    policy = RoutingPolicy.model_validate(body)
    out: dict[str, tuple[Signature, int]] = {}
    for route in policy.spec.routes:
        name = cluster_name(policy.metadata.name, route.name)
        hosts = sum(pool_sizes[target.pool] for tier in route.tiers for target in tier.pools)
        base = {
            "round_robin": "ROUND_ROBIN",
            "orca": "client_side_weighted_round_robin",
        }.get(route.balancing, "LEAST_REQUEST")
        out[name] = ((base, 0), hosts)
        affinity = route.session_affinity
        if affinity is not None:
            for suffix, factor in twins(affinity):
                out[name + suffix] = (("RING_HASH", factor), hosts)
    return out


def _policy_live(stack: Stack, expected: Mapping[str, tuple[Signature, int]]) -> bool:
    """Envoy's clusters balance as `expected` (``expected_clusters``) says, and every
    endpoint is healthy in each."""
    try:
        clusters = _clusters_in_envoy(stack.envoy)
    except Exception:
        return False
    # A queued service class has a cluster of its own, the route's with other circuit breakers.
    want = {
        name: expected.get(name.split(QUEUE_INFIX, 1)[0] if QUEUE_INFIX in name else name)
        for name in clusters
    }
    plain = {name for name in clusters if QUEUE_INFIX not in name}
    if plain != set(expected) or any(
        w is None or w[0] != clusters[name] for name, w in want.items()
    ):
        return False
    # Every endpoint healthy in every cluster.
    healthy: dict[str, int] = dict.fromkeys(clusters, 0)
    for line in stack.envoy.clusters().splitlines():
        name = line.split("::", 1)[0]
        if "::health_flags::" in line and name in healthy:
            if not line.endswith("::healthy"):
                return False
            healthy[name] += 1
    return all(healthy[name] == w[1] for name, w in want.items() if w is not None)


def apply_policy(
    stack: Stack,
    key: str,
    route: Mapping[str, Any],
    *,
    before: Sequence[Mapping[str, Any]] = (),
    pools: Mapping[str, int] | None = None,
    **spec: Any,
) -> None:
    """Apply the benchmark's RoutingPolicy with `route` after the routes `before` (and the
    further `spec` fields, such as ``serviceClasses``), and wait until Envoy serves it;
    `pools` gives each pool's endpoint count (default: one pool of every replica)."""
    body = policy_body(stack.listener_port, route, before)
    body["spec"].update(spec)
    stack.put(body)
    sizes = {POOL: len(stack.backends.replicas)} if pools is None else pools
    expected = expected_clusters(body, sizes)
    wait_until(lambda: _policy_live(stack, expected), 60, f"Envoy to serve {key}")


def _probe(stack: Stack) -> bool:
    """One request through Envoy is answered."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    with contextlib.suppress(httpx.HTTPError):
        return httpx.post(stack.url, json=body, timeout=10.0).status_code == 200
    return False


# --------------------------------------------------------------------------- telemetry


def telemetry_metrics(stack: Stack) -> dict[str, float]:
    """kvpilot's telemetry counters and per-endpoint weights for the pool."""
    text = httpx.get(f"{stack.kvpilot.api_url}/metrics", timeout=5.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or (f'pool="{POOL}"' not in line and "cause=" not in line):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def telemetry_fresh(stack: Stack) -> bool:
    """kvpilot has decided a weight from telemetry for every replica."""
    try:
        weights = [k for k in telemetry_metrics(stack) if k.startswith("kvpilot_telemetry_weight{")]
    except httpx.HTTPError:
        return False
    return len(weights) >= len(stack.backends.replicas)


# --------------------------------------------------------------------------- the replicas


def replica_metrics(stack: Stack) -> dict[str, dict[str, float]]:
    """Every replica's `/metrics`, by replica id."""
    out = {}
    for replica in stack.backends.replicas:
        out[replica.id] = parse_metrics(httpx.get(f"{replica.url}/metrics", timeout=5.0).text)
    return out


def _idle(stack: Stack) -> bool:
    """No replica runs or queues a request."""
    return all(
        m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0
        for m in replica_metrics(stack).values()
    )


async def _warm(stack: Stack, system_prompts: list[str]) -> None:
    """Send every shared system prompt to every replica once, straight (not through Envoy)."""

    async def one(client: httpx.AsyncClient, url: str) -> None:
        for prompt in system_prompts:
            body = {
                "model": MODEL,
                "messages": [{"role": "system", "content": prompt}],
                "max_tokens": 1,
            }
            (await client.post(f"{url}/v1/chat/completions", json=body)).raise_for_status()

    async with httpx.AsyncClient(timeout=60.0) as client:
        await asyncio.gather(*(one(client, r.url) for r in stack.backends.replicas))


def ready_for_replay(stack: Stack, system_prompts: list[str], idle_timeout: float = 60) -> None:
    """Once Envoy answers and the replicas are idle: empty every replica's prefix cache and
    zero its counters, then put the shared `system_prompts` back in every cache.

    A fleet that has been serving for a while holds its shared system prompts in every
    replica's cache (they are the most used blocks, and vLLM evicts a conversation from its
    end). Without them, the first minutes of every run pay for a cold start that no
    routing policy can avoid, and those few requests are the p99.
    """
    wait_until(lambda: _probe(stack), 30, "a request through Envoy")
    wait_until(lambda: _idle(stack), idle_timeout, "the replicas to go idle")
    stack.backends.reset()
    if system_prompts:
        asyncio.run(_warm(stack, system_prompts))
        wait_until(lambda: _idle(stack), 60, "the replicas to go idle after warming")
        stack.backends.reset(keep_cache=True)
